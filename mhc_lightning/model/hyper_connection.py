"""One wrapper for every sublayer: residual, HC, mHC, identity-HC, mHC-lite or KromHC (docs/design.md §1-§6, §15).

The maths lives in the kernels package (reference ops or fused kernels, chosen by `get_ops`);
this module only owns the parameters, their initialisation and the wiring.

mHC / identity-HC sublayers also run as a chain (`enter`, then `chain` per sublayer; model/recompute.py's
`run_sublayers` drives it): at each sublayer boundary one op writes sublayer l's output stream and computes
sublayer l+1's coefficients and input from it (kernels/reference/mhc_boundary.py): one op, and one autograd node,
per sublayer instead of two (host time; the kernels are the same, docs/kernels.md). `forward` is one sublayer on its
own. mHC-lite / KromHC sublayers run one at a time on the reference ops (`lite_enter`, `krom_enter`): no fused
kernels. What each mode learns and which ops it runs is its spec's (model/modes.py).
"""

import math
from typing import Optional

import torch
import torch.nn as nn

from ..kernels import MHCOptions, get_ops, reference
from ..kernels.reference import compute_dtype, in_dtype
from .branch_input import others_keep_saved_tensors, param_compute_dtype, rebuilt_in_backward, stream_spread
from .config import BIAS_INITS, HyperConfig
from .exact_init import exact_res_bias

# Between two chained sublayers: (stream x, the sublayer's input u, its h_pre, h_post, h_res | None). After `enter`
# under torch.compile, x is the fused ops' Routed pair (x and its gradient's route to the enter op; read only by the
# ops' write-backs, kernels/fused/custom_ops.py), so the sublayer takes its device from u.
Carry = tuple[object, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def mhc_bias_init(
    scheme: str, n: int, home: int, with_res: bool, res_gap: float = 6.0, pre_gap: float = 3.0
) -> torch.Tensor:
    """Biases [pre (n) | post (n) | res (n^2)] of docs/design.md §6; res logits are diagonal, so layout-free."""
    eye = torch.eye(n)
    onehot = eye[home]
    if scheme == "home":
        # read the home stream, write every stream (2 sigma(0) = 1), H_res = Sinkhorn(res_gap * I) ~ I
        pre, post, res = pre_gap * (2 * onehot - 1), torch.zeros(n), res_gap * eye
    elif scheme == "zeros":
        pre, post, res = torch.zeros(n), torch.zeros(n), torch.zeros(n, n)
    elif scheme == "hc_identity":
        pre, post, res = onehot, torch.ones(n), eye
    elif scheme == "a6":
        pre, post, res = 6 * onehot - 3, torch.zeros(n), 6 * eye - 3
    elif scheme == "near_identity":
        p = min(1.0 / n, 0.999)  # n = 1 would need logit(1) = inf
        pre, post, res = torch.full((n,), math.log(p / (1 - p))), torch.zeros(n), 10 * eye
    else:
        raise ValueError(f"bias_init must be one of {list(BIAS_INITS)}, got {scheme!r}")
    parts = [pre, post] + ([res.flatten()] if with_res else [])
    return torch.cat(parts)


class HyperConnection(nn.Module):
    """x_{l+1} = H_res x_l + H_post^T F(H_pre x_l) on x [..., n, C]; plain x + F(x) on [..., C] for residual."""

    def __init__(self, branch: nn.Module, d_model: int, layer_index: int, cfg: HyperConfig):
        super().__init__()
        self.branch, self.cfg, self.layer_index = branch, cfg, layer_index
        self.mode, self.spec = cfg.residual_mode, cfg.spec
        self.sinkhorn_iters = cfg.sinkhorn_iters  # per layer: the scheduler callback changes it at run time
        self.record = False  # when set, keep the first sequence's coefficients for diagnostics
        self.last: Optional[dict[str, torch.Tensor]] = None
        n, home = cfg.streams, layer_index % cfg.streams
        if self.spec.parameters == "phi":
            bias = mhc_bias_init(cfg.bias_init, n, home, self.spec.sinkhorn, cfg.res_gap, cfg.pre_gap)
            if self.spec.exact:  # [pre | post] as mHC's, then the family's own res logits
                bias = torch.cat([bias, exact_res_bias(self.spec, n, cfg.bias_init, cfg.res_gap)])
            self.phi = nn.Parameter(torch.empty(n * d_model, bias.numel()))
            self.bias = nn.Parameter(bias)
            self.alpha = nn.Parameter(torch.full((3,), cfg.alpha_init))
            self.reset_phi()
        elif self.spec.parameters == "hc":
            # HC paper §2.3: W = 0, s = 0.01, B = 1, A_m = e_{k mod n}, A_r = I -> exactly a pre-norm residual.
            self.norm_weight = nn.Parameter(torch.ones(d_model))
            self.w_beta = nn.Parameter(torch.zeros(d_model))
            self.w_m = nn.Parameter(torch.zeros(d_model))
            self.w_r = nn.Parameter(torch.zeros(d_model, n))
            self.s_alpha = nn.Parameter(torch.tensor(cfg.alpha_init))
            self.s_beta = nn.Parameter(torch.tensor(cfg.alpha_init))
            self.b_static = nn.Parameter(torch.ones(n))
            self.am_static = nn.Parameter(torch.eye(n)[home].clone())
            self.ar_static = nn.Parameter(torch.eye(n))

    def reset_phi(self) -> None:
        if self.cfg.phi_init == "zeros":
            nn.init.zeros_(self.phi)
        elif self.cfg.phi_init == "normal":
            nn.init.normal_(self.phi, std=self.cfg.phi_std)
        else:
            nn.init.xavier_uniform_(self.phi)

    @property
    def chains(self) -> bool:
        """True when this sublayer can run in a chain (mHC / identity-HC: coefficients from phi)."""
        return self.spec.chains

    def ops(self, device: torch.device):
        """The ops this sublayer runs on (the exact families' are always the reference: HyperConfig.ops_backend)."""
        return get_ops(self.cfg.ops_backend, device)

    def options(self) -> MHCOptions:
        c = self.cfg
        return MHCOptions(
            sinkhorn_iters=self.sinkhorn_iters,
            sinkhorn_eps=c.sinkhorn_eps,
            exact_axis=c.sinkhorn_exact_axis,
            start=c.sinkhorn_start,
            res_layout=c.res_layout,
            pre_eps=c.pre_eps,
            post_mult=c.post_mult,
        )

    def branch_dtype(self) -> Optional[torch.dtype]:
        """The dtype the branch takes its input in: the one it computes in (its parameters', or FSDP's mixed-precision
        param_dtype where FSDP wraps it; None: no floating parameters)."""
        return param_compute_dtype(self.branch)

    def run_branch(
        self, u: torch.Tensor, x: Optional[torch.Tensor] = None, h_pre: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """F(u) in the branch's parameter dtype. The stream may be narrower (GPTConfig.stream_dtype): the branch
        then sees the dtype it would see with a full-precision stream, and autocast still casts its matmuls. The mHC
        ops hand u over in that dtype already (their u_dtype: the fused kernels write it so, no cast each way).
        x, h_pre: the flat stream and coefficients u came from; with rebuild_branch_input the branch's saved copy of u
        is dropped and rebuilt from them in the backward (model/branch_input.py), unless other saved-tensor hooks (an
        outer checkpoint) already decide what the branch keeps."""
        dtype = self.branch_dtype()
        v = in_dtype(u, dtype)
        if x is None or not (self.cfg.rebuild_branch_input and torch.is_grad_enabled()) or others_keep_saved_tensors():
            return self.branch(v)
        ops = self.ops(v.device)
        if ops is reference and compute_dtype(x.dtype) != x.dtype:
            # the reference ops then keep their fp32 copy of x, not x: holding x for the rebuild would cost n C
            return self.branch(v)
        # the fused write-back's backward, which runs first and reads x anyway, writes u on request; else u is
        # rebuilt from x by itself (one more read of x)
        request, shape = ops.request_u(x, h_pre, dtype), v.shape  # not v itself: the recipe outlives the forward

        def rebuild() -> torch.Tensor:
            u = request.u if request is not None and request.u is not None else ops.rebuild_u(x, h_pre, dtype)
            return in_dtype(u, dtype).view(shape)

        with rebuilt_in_backward(v, rebuild):
            return self.branch(v)

    def remember(
        self,
        h_pre: torch.Tensor,
        h_post: torch.Tensor,
        h_res: Optional[torch.Tensor],
        out: torch.Tensor,
        lead: Optional[tuple] = None,
        x_in: Optional[torch.Tensor] = None,
    ) -> None:
        """Keep the first sequence's coefficients for diagnostics while `record` is set; out is the stream this
        sublayer wrote, x_in the one it read. lead: the stream's leading dims when the tensors come flat
        ([tokens, ...], `forward`). For mHC also the range of the res logits Sinkhorn started from (its saturation),
        recomputed by the reference on that one sequence: the ops return H^res, not its logits."""
        if self.record:
            if lead is not None:
                n = out.shape[-2]
                h_pre, h_post, out = h_pre.view(*lead, n), h_post.view(*lead, n), out.view(*lead, *out.shape[-2:])
                h_res = None if h_res is None else h_res.view(*lead, n, n)
                x_in = None if x_in is None else x_in.view(*lead, *x_in.shape[-2:])
            self.last = {
                "h_pre": h_pre[:1].detach(),
                "h_post": h_post[:1].detach(),
                "h_res": None if h_res is None else h_res[:1].detach(),
                "spread": stream_spread(out[:1].detach()),
            }
            if self.spec.sinkhorn and x_in is not None:
                with torch.no_grad():  # no matmul op: the forward may run inside a selective checkpoint
                    z = reference.mhc_res_logits(
                        x_in[:1].detach(),
                        self.phi,
                        self.bias,
                        self.alpha,
                        self.options(),
                        matmul=reference.columnwise_matmul,
                    )
                self.last["logit_range"] = (z.amax(dim=(-2, -1)) - z.amin(dim=(-2, -1))).detach()

    def enter(self, x: torch.Tensor) -> Carry:
        """The first sublayer of a chain: its coefficients and input u from the stream x (one read of x), and the stream
        its write-back reads (through the op, so that x's two gradients meet in one kernel). The carry holds the stream
        and coefficients flat ([tokens, n, C], [tokens, n]) and u in x's leading shape, for the branch: each op then
        takes them as they are (host time per op, docs/kernels.md)."""
        lead, C = x.shape[:-2], x.shape[-1]
        ops = self.ops(x.device)
        xt, u, h_pre, h_post, h_res = self.enter_op(ops, x if x.dim() == 3 else x.reshape(-1, *x.shape[-2:]))
        return xt, u.view(*lead, C), h_pre, h_post, h_res

    def enter_op(self, ops, x: torch.Tensor) -> tuple:
        """The spec's enter op on the flat stream x [tokens, n, C] with this sublayer's parameters: (the stream its
        write-back reads, u, h_pre, h_post, h_res)."""
        enter = getattr(ops, self.spec.enter)
        if self.spec.parameters == "hc":
            c = self.cfg
            # x' (the stream the write-back reads) comes out of the same op, so x's gradients meet in its x pass
            return enter(
                x,
                self.norm_weight,
                self.w_beta,
                self.w_m,
                self.w_r,
                self.s_alpha,
                self.s_beta,
                self.b_static,
                self.am_static,
                self.ar_static,
                dynamic=c.hc_dynamic,
                use_tanh=c.hc_tanh,
                u_dtype=self.branch_dtype(),
            )
        return enter(x, self.phi, self.bias, self.alpha, self.options(), self.branch_dtype())

    def chain(self, carry: Carry, nxt: Optional["HyperConnection"]):
        """Run the branch on the carried input and write its output back into the stream. With a next sublayer, the
        same op computes that sublayer's coefficients and input (the Carry for `nxt.chain`); without one, returns
        the stream in the shape `enter` received it."""
        x, u, h_pre, h_post, h_res = carry
        lead, C = u.shape[:-1], u.shape[-1]
        ops = self.ops(u.device)
        f = self.run_branch(u, x, h_pre).reshape(-1, C)
        if nxt is None:
            out = getattr(ops, self.spec.exit)(x, f, h_post, h_res)
            self.remember(h_pre, h_post, h_res, out, lead, x)
            return out.view(*lead, *out.shape[-2:])
        x_next, u_next, *coefs = ops.mhc_boundary(
            x, f, h_post, h_res, nxt.phi, nxt.bias, nxt.alpha, nxt.options(), nxt.branch_dtype()
        )
        self.remember(h_pre, h_post, h_res, x_next, lead, x)
        return (x_next, u_next.view(*lead, C), *coefs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.spec.multi_stream:
            return x + self.run_branch(x).to(x.dtype)  # the stream keeps its dtype (the mHC ops do the same)
        # The ops run on the flat stream [tokens, n, C] and the branch on [..., C]: four views per sublayer, where
        # each op reshaping its inputs and outputs took about a dozen (host time in the eager step, docs/kernels.md)
        lead, (n, C) = x.shape[:-2], x.shape[-2:]
        flat = x if x.dim() == 3 else x.reshape(-1, n, C)
        ops = self.ops(x.device)
        xt, u, h_pre, h_post, h_res = self.enter_op(ops, flat)
        f = self.run_branch(u.view(*lead, C), xt, h_pre)
        out = getattr(ops, self.spec.exit)(xt, f.view(-1, C), h_post, h_res)
        self.remember(h_pre, h_post, h_res, out, lead, flat)
        return out.view(*lead, n, C)

    def extra_repr(self) -> str:
        out = f"mode={self.mode}, layer={self.layer_index}, n={self.cfg.streams}"
        return out + (f", sinkhorn_iters={self.sinkhorn_iters}" if self.spec.sinkhorn else "")


def hyper_connections(module: nn.Module) -> list[HyperConnection]:
    """The HyperConnection sublayers under `module`, in order, themselves: also where another tool wrapped them. A
    wrapper (an activation-checkpoint or FSDP wrapper) forwards reads of attributes to the module it wraps but keeps
    writes for itself, so a flag or a Sinkhorn count set through it would never reach the sublayer
    (docs/design.md §9)."""
    return [m for m in module.modules() if isinstance(m, HyperConnection)]
