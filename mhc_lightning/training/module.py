"""LightningModule: next-token LM training of the GPT with residual / HC / mHC sublayers."""

import copy
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

import lightning as L
import torch
import torch._inductor
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity

from ..model import GPT, GPTConfig
from ..model.gpt import compile_model
from .diagnostics import grad_norm_summary, summarize
from .distributed import reduce_diagnostics
from .schedule import WarmupCosine
from .sharding import clean_name, decays, fully_shard_model, local_tensor, shard_group


def host_scalar(value: float) -> torch.Tensor:
    """A Python number as a CPU tensor for `self.log`. Lightning turns a plain number into a tensor on the module's
    device, a blocking host-to-device copy: on a GPU every such log waits for the queued step to finish, and the
    next step then starts on an idle GPU (docs/kernels.md, "Host time"). A CPU tensor is logged as it is."""
    return torch.tensor(float(value), dtype=torch.float32)


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr_ratio * lr (per optimizer step)."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    # AdamW's implementation: None picks torch's fused kernel when every parameter is on a CUDA device (one pass over
    # parameters, gradients and moments instead of a dozen foreach passes), else its default (foreach); true / false
    # force fused / foreach
    fused: Optional[bool] = None

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if self.fused not in (None, True, False):
            raise ValueError(f"fused must be true, false or null (auto), got {self.fused!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must each be in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def _as(cls, value):
    return cls(**value) if isinstance(value, dict) else value


# Lightning precisions with a GradScaler (loss scaling)
SCALED_PRECISIONS = ("16-mixed", "16")


def check_fused(fused: Optional[bool], precision) -> None:
    """A fused AdamW step unscales 16-mixed's gradients inside the step, after on_before_optimizer_step has logged
    them and clipping has clipped them, both still scaled: refused there (auto picks foreach)."""
    if fused and str(precision) in SCALED_PRECISIONS:
        raise ValueError(
            f"model.optim.fused=true needs a precision without loss scaling, not trainer.precision="
            f"{precision} (the fused step unscales the gradients only after they were logged and clipped);"
            " allowed with it: 32-true, bf16-mixed, bf16-true; or set model.optim.fused to false or null"
        )


def check_compile(arch: GPTConfig, compile: bool, compile_mode: str = "default") -> None:
    """Refuse what is known not to compile: the chained mHC stack under torch.compile, which does not finish its first
    step on a GPU (docs/benchmarks.md, "Host time"), while one sublayer at a time compiles (what chain_sublayers auto
    traces under torch.compile); the branch input's rebuild (saved-tensor hooks, which dynamo refuses to trace).
    compile_mode: one of torch.compile's modes (the list is torch's own)."""
    modes = list(torch._inductor.list_mode_options())
    if compile_mode not in modes:
        raise ValueError(
            f"model.compile_mode: {compile_mode!r} is not a torch.compile mode; allowed: {', '.join(modes)}"
        )
    if compile and arch.hyper.chain_sublayers is True and arch.hyper.spec.chains:
        raise ValueError(
            "model.compile=true with model.arch.hyper.chain_sublayers=true is refused: the chained stack "
            "does not finish compiling (docs/benchmarks.md); set one of them to false"
        )
    if compile and arch.hyper.rebuild_branch_input and arch.hyper.spec.multi_stream:
        raise ValueError(
            "model.compile=true with model.arch.hyper.rebuild_branch_input=true is refused: dynamo does "
            "not trace the saved-tensor hooks that drop the branch's input (the compiler chooses what to "
            "keep); set one of them to false"
        )


class LitLM(L.LightningModule):
    """Byte-level language model. `arch` and `optim` appear as --model.arch.* and --model.optim.* in the CLI.

    diagnostics_every: every k optimizer steps, record one sequence's H coefficients during the
    training forward (no extra forward) and log Amax gains, Sinkhorn residuals and coefficient ranges.
    """

    def __init__(
        self,
        # instances as defaults, so that the CLI reads them from the signature; never mutated: copied below
        arch: GPTConfig = GPTConfig(),  # noqa: B008
        optim: OptimConfig = OptimConfig(),  # noqa: B008
        diagnostics_every: int = 25,
        compile: bool = False,
        compile_mode: str = "default",
    ):
        super().__init__()
        arch, optim = copy.deepcopy(_as(GPTConfig, arch)), copy.deepcopy(_as(OptimConfig, optim))
        if diagnostics_every < 0:
            raise ValueError(f"diagnostics_every must be >= 0 (0 = off), got {diagnostics_every}")
        check_compile(arch, compile, compile_mode)
        self.arch, self.optim = arch, optim
        self.diagnostics_every = diagnostics_every
        self.save_hyperparameters(
            {
                "arch": asdict(arch),
                "optim": asdict(optim),
                "diagnostics_every": diagnostics_every,
                "compile": compile,
                "compile_mode": compile_mode,
            }
        )
        self.model = GPT(arch)
        self.forward_fn = compile_model(self.model, mode=compile_mode) if compile else self.model
        # reduce-overhead replays CUDA graphs whose outputs the next replay overwrites: each model call starts a new
        # "step" for them (the previous call's logits are used up by then; its backward has run)
        self._graph_steps = compile and torch._inductor.list_mode_options(compile_mode).get("triton.cudagraphs", False)
        self.val_loss = MeanMetric()
        self.val_ppl = Perplexity()
        self._last_grad_norm: Optional[torch.Tensor] = None  # on the device; `last_grad_norm` reads it on demand
        self._t_last: Optional[float] = None
        # ---- hooks for the callbacks (mhc_lightning/callbacks); inert unless a callback reads or sets them ----
        self.last_loss: Optional[torch.Tensor] = None  # detached loss of the latest training_step (None: skipped)
        self.last_diagnostics: dict[str, float] = {}  # scalars of the latest diagnostics step
        self.last_per_layer: Optional[dict[str, list[float]]] = None  # its curves per layer (PerLayerArtifacts)
        self.last_diagnostics_step: int = -1  # global_step at which last_diagnostics / last_per_layer were taken
        self.skip_batch = False  # set in on_train_batch_start: training_step returns None (no backward, no update)
        self.skip_optimizer_step = False  # set in on_before_optimizer_step: gradients dropped, no parameter update
        self.lr_scale = 1.0  # multiplies every param group's lr during the optimizer step (rollback cool-down)
        self._diagnostics_requested = False
        self._grad_norms: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._grad_groups: Optional[tuple[list[torch.nn.Parameter], torch.Tensor]] = None
        self._shard_group = None  # sharded strategies: where the shards' squared grad norms add up (sharding.py)
        self._fully_sharded = False
        # every step's pre-clip grad norm, on the device (written without a host sync): the max and spike count over
        # every step, which the logged curve (every log_every_n_steps-th step) would miss
        self._grad_norm_steps: Optional[torch.Tensor] = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self._graph_steps:
            torch.compiler.cudagraph_mark_step_begin()
        return self.forward_fn(idx)

    # ---- training -------------------------------------------------------------------------
    def diagnostics_due(self) -> bool:
        k = self.diagnostics_every
        return self.model.multi_stream and (self._diagnostics_requested or (bool(k) and self.global_step % k == 0))

    def request_diagnostics(self) -> None:
        """Record and summarize the coefficients in the next training step even off the diagnostics_every cadence."""
        self._diagnostics_requested = True

    @staticmethod
    def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def batch_loss(self, batch) -> torch.Tensor:
        """Loss of one (x, y) batch without logging or recording (probe batches of the snapshot callback)."""
        x, y = batch
        return self.lm_loss(self(x), y)

    def training_step(self, batch, batch_idx):
        self._grad_norms = None
        if self.skip_batch:  # a callback skips this batch (data window after a rollback): no update
            self.skip_batch, self.last_loss = False, None
            self.log("train/skipped_batch", host_scalar(1.0), on_step=True, on_epoch=False)
            if self.trainer.world_size == 1:
                return None  # no backward at all
            # DDP rejects a None loss: every rank must run backward so its gradient hooks all-reduce. A zero
            # loss keeps them in step, and the update is vetoed like a skipped step.
            self.skip_optimizer_step = True
            return self.lm_loss(self(batch[0]), batch[1]) * 0.0
        x, y = batch
        if self.diagnostics_due():
            self._diagnostics_requested = False
            with self.model.recording():
                logits = self(x)
            scalars, self.last_per_layer = summarize(self.model.recorded())
            # DDP: one recorded sequence per rank, reduced so every rank (and the callbacks acting on them)
            # holds the same values; rank 0 logs them. No-op in a single process.
            scalars, self.last_per_layer = reduce_diagnostics(scalars, self.last_per_layer, self.device)
            self.last_diagnostics, self.last_diagnostics_step = scalars, self.global_step
            self._log_diagnostics(scalars)
        else:
            logits = self(x)
        loss = self.lm_loss(logits, y)
        self.last_loss = loss.detach()
        # Not prog_bar=True: Lightning reads every progress-bar value back to the host after every step (even with no
        # bar), which on a GPU makes each step wait for the last. The bar's loss comes from on_train_batch_end.
        self.log("train/loss", loss, on_step=True, on_epoch=False)
        return loss

    def _log_diagnostics(self, scalars: dict[str, float]) -> None:
        """The diagnostics at the step they were taken. Through self.log they would reach the logger only at the next
        log_every_n_steps flush, under that step and overwritten by any later diagnostics step before it (at k = 7
        and a flush every 10 steps, the values of steps 0 and 21 were lost and step 7's was logged as step 9). So the
        loggers get them directly (rank 0; the values are the same on every rank), and self.log(logger=False) keeps
        them in callback_metrics, where sweep objectives read them (as host tensors: `host_scalar`)."""
        self.log_dict({k: host_scalar(v) for k, v in scalars.items()}, on_step=True, on_epoch=False, logger=False)
        if self.trainer.is_global_zero:
            for lg in self.trainer.loggers:
                lg.log_metrics(scalars, step=self.global_step)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        bar = self.trainer.progress_bar_callback is not None
        # on the progress bar too, where there is one: host numbers, whose read-back waits for no GPU
        if self._t_last is not None:
            tokens_per_sec = batch[0].numel() / (now - self._t_last)
            self.log("train/tokens_per_sec", host_scalar(tokens_per_sec), on_step=True, on_epoch=False, prog_bar=bar)
        self._t_last = now
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.log("train/lr", host_scalar(lr), on_step=True, on_epoch=False, prog_bar=bar)
        # The progress bar's loss: read back every log_every_n_steps steps (one wait for the GPU there, at the cadence
        # the loggers read their values anyway) and shown as a host number in between.
        if bar and self.last_loss is not None and (self.global_step - 1) % max(1, self.trainer.log_every_n_steps) == 0:
            self.log("loss", host_scalar(self.last_loss), on_step=True, on_epoch=False, prog_bar=True, logger=False)

    def grad_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(global grad norm, per-sublayer grad norms [L]) of the current gradients, computed once per step.

        Sublayer l groups every parameter under model.sublayers.l (branch and its HC coefficients); embedding,
        final norm and head are in the global norm only. Valid from backward until the next training_step. Under a
        sharding strategy each rank holds shards: their squared norms are summed over the ranks (one all-reduce of
        L + 1 numbers), so every rank gets the global norms.
        """
        if self._grad_norms is None:
            if self._grad_groups is None:
                params, group, spare = [], [], len(self.model.sublayers)  # spare slot: embedding, norm, head
                for name, p in self.model.named_parameters():
                    parts = clean_name(name).split(".")
                    params.append(p)
                    group.append(int(parts[1]) if parts[0] == "sublayers" else spare)
                self._grad_groups = (params, torch.tensor(group), {})
            params, group, on_device = self._grad_groups
            with_grad = [i for i, p in enumerate(params) if p.grad is not None]
            n_layers = len(self.model.sublayers)
            per_layer = torch.zeros(n_layers + 1, device=self.device)
            if with_grad:
                norms = torch.stack(
                    torch._foreach_norm([local_tensor(params[i].grad).detach().float() for i in with_grad])
                )
                if len(with_grad) == len(params):  # the usual case: reuse the index on the device
                    g = on_device.get(norms.device)
                    if g is None:
                        g = on_device[norms.device] = group.to(norms.device)
                else:
                    g = group[with_grad].to(norms.device)
                per_layer = per_layer.to(norms.device).index_add_(0, g, norms.square())
            if self._shard_group is not None:  # every rank, with or without local gradients
                torch.distributed.all_reduce(per_layer, group=self._shard_group)
            self._grad_norms = (per_layer.sum().sqrt(), per_layer[:n_layers].sqrt())
        return self._grad_norms

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The latest step's pre-clip global grad norm as a float (a host sync, paid only by a reader: the step itself
        keeps it on the device, so the host can queue the next step's kernels while the GPU finishes this one)."""
        return None if self._last_grad_norm is None else float(self._last_grad_norm)

    def on_before_optimizer_step(self, optimizer) -> None:
        # Called before clipping (and after unscaling under 16-mixed): this is the pre-clip norm,
        # the one that clipping would otherwise hide (docs/design.md §7).
        total = self.grad_norms()[0]
        self._last_grad_norm = total.detach()
        self.log("train/grad_norm", total, on_step=True, on_epoch=False)
        self._keep_grad_norm(self._last_grad_norm)
        if self.skip_optimizer_step:
            # A stability callback vetoed this update (runs after the callbacks' hooks): with no gradients,
            # AdamW leaves parameters and moments untouched; the step counter and LR schedule still advance.
            self.skip_optimizer_step = False
            optimizer.zero_grad(set_to_none=True)
            self.log("train/skipped_step", host_scalar(1.0), on_step=True, on_epoch=False)

    def _keep_grad_norm(self, norm: torch.Tensor) -> None:
        step, kept = self.global_step, self._grad_norm_steps
        if kept is None or kept.device != norm.device or step >= kept.numel():
            size = max(step + 1, int(self.trainer.max_steps) if self.trainer.max_steps > 0 else 2 * (step + 1))
            grown = torch.full((size,), float("nan"), device=norm.device)
            if kept is not None:
                grown[: min(kept.numel(), size)] = kept[:size].to(norm.device)
            self._grad_norm_steps = kept = grown
        kept[step] = norm.float()

    def _log_grad_norm_summary(self) -> None:
        """train/grad_norm_max and train/grad_spikes over every step so far (rank 0; the norm is global, the same on
        every rank). Called after each validation, where the host waits for the device anyway; every fit ends with one
        (FinalValidation)."""
        kept = self._grad_norm_steps
        if kept is None or not self.trainer.is_global_zero:
            return
        norms = kept[: self.global_step]
        summary = grad_norm_summary(norms[~norms.isnan()], self.optim.warmup_steps)
        if summary:
            for lg in self.trainer.loggers:
                lg.log_metrics(summary, step=self.global_step)

    def on_train_start(self) -> None:
        # The checkpoint of a resumed run restored the schedule it was planned with; a new budget (`mhc fit --extend`,
        # refused without it) continues the cosine from here to the new last step (schedule.py)
        sched, total = self.lr_schedulers(), int(self.trainer.estimated_stepping_batches)
        plan = sched.lr_lambdas[0] if isinstance(sched, torch.optim.lr_scheduler.LambdaLR) else None
        if isinstance(plan, WarmupCosine) and plan.total != total:
            before, step, lr = plan.total, self.global_step, self.optim.lr
            plan.extend(step, total)
            rank_zero_info(
                f"learning-rate schedule extended at step {step}: planned for {before} steps, now {total}; "
                f"lr {lr * plan(step):.3g} at step {step} -> {lr * plan(total):.3g} at step {total}"
            )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._grad_norm_steps is not None:
            checkpoint["grad_norm_steps"] = self._grad_norm_steps[: self.global_step].cpu()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "grad_norm_steps" in checkpoint:
            self._grad_norm_steps = checkpoint["grad_norm_steps"].clone()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Norm clipping by the global norm `grad_norms` computed for this step's log (on_before_optimizer_step runs
        just before): one pass over the gradients instead of two (`clip_grad_norm_` would compute the same norm
        again), and a fused AdamW keeps its clipping under bf16-mixed (Lightning's mixed-precision plugin refuses to
        clip for an optimizer that could unscale in its step). Whole gradients on every rank only (one device, DDP);
        sharded ones (FSDP, FSDP2: the global norm over the shards, each rank scaling its own); other strategies and
        value clipping go to Lightning."""
        clip = self.trainer.gradient_clip_val if gradient_clip_val is None else gradient_clip_val
        algorithm = (gradient_clip_algorithm or self.trainer.gradient_clip_algorithm or "norm").lower()
        ours = isinstance(self.trainer.strategy, (SingleDeviceStrategy, DDPStrategy)) or self._shard_group is not None
        if not clip or algorithm != "norm" or not ours:
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        grads = [local_tensor(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:  # as clip_grad_norm_: scale by clip / (norm + 1e-6) where that is below 1
            coef = torch.clamp(float(clip) / (self.grad_norms()[0] + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].device))

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        scale = self.lr_scale
        if scale == 1.0:
            return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # Scale only for this update and restore before the LR scheduler steps, so any scheduler
        # (chainable or not) keeps its own trajectory.
        saved = [g["lr"] for g in optimizer.param_groups]
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * scale
        try:
            return super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        finally:
            for g, lr in zip(optimizer.param_groups, saved):
                g["lr"] = lr

    # ---- validation -----------------------------------------------------------------------
    def _eval_step(self, batch):
        x, y = batch
        logits = self(x).float()
        self.val_loss.update(F.cross_entropy(logits.flatten(0, 1), y.flatten()), weight=y.numel())
        self.val_ppl.update(logits, y)

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch)

    def test_step(self, batch, batch_idx):
        self._eval_step(batch)

    def _eval_epoch_end(self, stage: str) -> None:
        loss = self.val_loss.compute()  # nats per token
        # bits per byte = nats per token / ln 2 / bytes per token (1 for bytes; the data's own ratio for tokens)
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        per_token = getattr(dm, "bytes_per_token", 1.0)
        self.log(f"{stage}/loss", loss, prog_bar=True)  # next to the training loss in the progress bar
        self.log_dict({f"{stage}/bpb": loss / math.log(2) / per_token, f"{stage}/ppl": self.val_ppl.compute()})
        self.val_loss.reset()
        self.val_ppl.reset()

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")
        if not self.trainer.sanity_checking:
            self._log_grad_norm_summary()

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    # ---- optimisation ---------------------------------------------------------------------
    def param_groups(self) -> list[dict[str, Any]]:
        """Weight decay only on the branch matrices and the embedding; never on norms, biases or HC coefficients.
        Decided by name (sharding.decays): FSDP hands the optimizer flat shards, whose shapes say nothing."""
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (decay if decays(name) else no_decay).append(p)
        return [{"params": decay, "weight_decay": self.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    def configure_model(self) -> None:
        """Lightning's ModelParallelStrategy: FSDP2 over its data-parallel mesh (sharding.py). Other strategies wrap
        the model themselves (FSDPStrategy) or not at all. Outside a Trainer (`LitLM.load_from_checkpoint` calls this
        hook too) there is nothing to shard."""
        trainer = self._trainer  # the `trainer` property raises when the module is not attached to one
        if (
            trainer is not None
            and type(trainer.strategy).__name__ == "ModelParallelStrategy"
            and not self._fully_sharded
        ):
            fully_shard_model(self.model, self.device_mesh)
            self._fully_sharded = True

    def setup(self, stage: str) -> None:
        self._shard_group = shard_group(self.trainer.strategy)

    def configure_optimizers(self):
        o = self.optim
        groups = self.param_groups()
        check_fused(o.fused, self.trainer.precision)
        fused = o.fused
        if fused is None:
            fused = str(self.trainer.precision) not in SCALED_PRECISIONS and all(
                p.is_cuda for g in groups for p in g["params"]
            )
        # fused=False would also turn foreach off: None leaves torch its default
        opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True if fused else None)
        total = int(self.trainer.estimated_stepping_batches)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(o.warmup_steps, total, o.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
