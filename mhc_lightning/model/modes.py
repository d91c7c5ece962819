"""The residual modes, one spec each: where one mode differs from another is written here (docs/design.md §1-§6, §15).

Everything that depends on the mode asks its spec: the sublayer (its parameters, enter and exit ops, chaining), the
config's checks, the callbacks that touch Sinkhorn, and the reports and launchers that judge keys by mode. Free of
torch, so that `mhc grid`, `mhc sweep` and the reports read it without loading torch. A new mode is one entry in
MODES plus its ops (kernels/) and tests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib import import_module
from typing import Any, Literal, Optional, get_args

ResidualMode = Literal["residual", "hc", "mhc", "identity", "mhc_lite", "kromhc"]
RESIDUAL_MODES: tuple[str, ...] = get_args(ResidualMode)
DEFAULT_MODE: ResidualMode = "mhc"
SINKHORN_KEYS = ("sinkhorn_",)  # every HyperConfig field named sinkhorn_*


@dataclass(frozen=True)
class ModeSpec:
    """One residual mode.

    parameters: what each sublayer learns (HyperConnection sets them up): phi = one projection of the flattened
        stream through phi, with biases and gates alpha (docs/design.md §2; biases by `mhc_bias_init`); hc = HC's own
        (docs/design.md §5); None = nothing, the sublayer is x + F(x).
    res: how H_res comes about: sinkhorn = n^2 logits projected by Sinkhorn-Knopp (docs/design.md §3); identity =
        no logits, H_res = I; exact = exactly doubly stochastic without Sinkhorn, by the family its enter op runs
        (kernels/reference/exact_coefficients.py, docs/design.md §15); hc = HC's unconstrained A_r; None = one stream,
        no H_res.
    res_init: for res=exact, the function of model/exact_init.py that gives the res logits' biases at t = 0.
    enter, exit: the ops (of the module `get_ops` picks) that compute a sublayer's coefficients and input from the
        stream, and write its branch's output back into it; None: a plain residual.
    fused: has fused (Triton) kernels; without, its ops are the torch reference whatever kernel_backend says, and
        kernel_backend=triton is refused.
    chains: consecutive sublayers can run as one chain through the fused boundary op (model/recompute.py).
    streams: the n_streams it allows: None = any n >= 1; else the name of the kernels.reference tuple that lists them.
    ignores: HyperConfig fields (a name ending in _ stands for every field it starts) the mode does not read and a
        reader would take for a setting of the run: reports leave them blank.
    warns: of those, the ones `mhc fit`, `mhc grid` and `mhc sweep` call a no-op when set away from their default: a
        config written for mhc carries them, and the run would differ from another only in its name.
    """

    name: str
    parameters: Optional[Literal["phi", "hc"]]
    res: Optional[Literal["sinkhorn", "identity", "exact", "hc"]]
    enter: Optional[str]
    exit: Optional[str]
    fused: bool
    chains: bool
    res_init: Optional[str] = None
    streams: Optional[str] = None
    ignores: tuple[str, ...] = ()
    warns: tuple[str, ...] = ()

    @property
    def multi_stream(self) -> bool:
        """n residual streams (n_streams) rather than one."""
        return self.parameters is not None

    @property
    def sinkhorn(self) -> bool:
        """H_res by Sinkhorn: sinkhorn_iters and the SinkhornScheduler act on it."""
        return self.res == "sinkhorn"

    @property
    def exact(self) -> bool:
        """H_res exactly doubly stochastic without Sinkhorn."""
        return self.res == "exact"

    def allowed_streams(self) -> Optional[tuple[int, ...]]:
        """The n_streams this mode takes (None: any n >= 1), as the kernels list them."""
        if self.streams is None:
            return None
        return getattr(import_module("mhc_lightning.kernels.reference"), self.streams)

    def warns_about(self, key: str) -> bool:
        """Whether setting HyperConfig field `key` in this mode gets the no-op warning."""
        return key.startswith(self.warns)

    def ignored_settings(self, hyper: Any) -> dict[str, Any]:
        """The fields of HyperConfig `hyper` this mode warns about that are set away from their default."""
        return {
            f.name: getattr(hyper, f.name)
            for f in fields(hyper)
            if self.warns_about(f.name) and getattr(hyper, f.name) != f.default
        }


MODES: dict[str, ModeSpec] = {
    s.name: s
    for s in (
        # x + F(x)
        ModeSpec(
            "residual",
            parameters=None,
            res=None,
            enter=None,
            exit=None,
            fused=True,
            chains=False,
            ignores=SINKHORN_KEYS + ("n_streams", "alpha_init", "bias_init"),
        ),
        # dynamic Hyper-Connections, unconstrained
        ModeSpec(
            "hc",
            parameters="hc",
            res="hc",
            enter="hc_enter",
            exit="stream_post_res",
            fused=True,
            chains=False,
            ignores=SINKHORN_KEYS + ("bias_init",),
        ),
        # manifold-constrained HC
        ModeSpec(
            "mhc",
            parameters="phi",
            res="sinkhorn",
            enter="mhc_enter",
            exit="stream_post_res",
            fused=True,
            chains=True,
        ),
        # mHC with H_res = I
        ModeSpec(
            "identity",
            parameters="phi",
            res="identity",
            enter="mhc_enter",
            exit="stream_post_res",
            fused=True,
            chains=True,
            ignores=SINKHORN_KEYS,
        ),
        # H_res a convex combination of the n! permutation matrices
        ModeSpec(
            "mhc_lite",
            parameters="phi",
            res="exact",
            enter="lite_enter",
            exit="stream_post_res",
            fused=False,
            chains=False,
            res_init="lite_res_bias",
            streams="LITE_STREAMS",
            ignores=SINKHORN_KEYS,
            warns=SINKHORN_KEYS,
        ),
        # H_res a Kronecker product of 2 x 2 doubly stochastic factors
        ModeSpec(
            "kromhc",
            parameters="phi",
            res="exact",
            enter="krom_enter",
            exit="stream_post_res",
            fused=False,
            chains=False,
            res_init="krom_res_bias",
            streams="KROM_STREAMS",
            ignores=SINKHORN_KEYS,
            warns=SINKHORN_KEYS,
        ),
    )
}


def spec(mode: str) -> ModeSpec:
    """The spec of residual_mode `mode`; ValueError naming the allowed modes for any other."""
    if mode not in MODES:
        raise ValueError(f"residual_mode must be one of {list(RESIDUAL_MODES)}, got {mode!r}")
    return MODES[mode]


def warning_modes(key: str) -> list[str]:
    """The modes that call setting HyperConfig field `key` a no-op."""
    return [name for name, s in MODES.items() if s.warns_about(key)]
