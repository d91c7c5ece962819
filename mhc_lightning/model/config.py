"""Architecture configuration: plain dataclasses that LightningCLI exposes field by field."""

from dataclasses import dataclass, field
from typing import Literal, Union, get_args

from ..kernels.options import (
    EXACT_AXES,
    KERNEL_BACKENDS,
    RES_LAYOUTS,
    SINKHORN_ITERS,
    STARTS,
    ExactAxis,
    KernelBackend,
    ResLayout,
    SinkhornStart,
)
from .modes import DEFAULT_MODE, ModeSpec, ResidualMode, spec

BiasInit = Literal["home", "zeros", "hc_identity", "a6", "near_identity"]
BIAS_INITS = get_args(BiasInit)
# Inits whose biases treat every stream alike: with phi = 0 the n streams then stay identical for the whole run
# (docs/design.md §6, "the symmetric trap").
SYMMETRIC_BIAS_INITS = ("zeros", "near_identity")
PhiInit = Literal["zeros", "normal", "xavier"]
PHI_INITS = get_args(PhiInit)
Collapse = Literal["sum", "head"]
COLLAPSES = get_args(Collapse)
StreamDtype = Literal["auto", "float32", "bfloat16", "float16"]
STREAM_DTYPES = get_args(StreamDtype)


def _one_of(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _at_least(name: str, value, low) -> None:
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")


@dataclass
class HyperConfig:
    """How each attention / MLP sublayer is wired into the residual stream.

    residual_mode: residual = x + F(x); hc = dynamic Hyper-Connections (unconstrained);
        mhc = manifold-constrained HC (H_res projected by Sinkhorn-Knopp); identity = mhc with H_res = I;
        mhc_lite = H_res a convex combination of the n! permutation matrices, kromhc = H_res a Kronecker product of
        2 x 2 doubly stochastic factors (both exactly doubly stochastic, no Sinkhorn; docs/design.md §15).
    n_streams: number of residual streams n (ignored by residual; the paper uses 4).
    """

    residual_mode: ResidualMode = DEFAULT_MODE
    n_streams: int = 4
    sinkhorn_iters: int = SINKHORN_ITERS  # t_max; changed at run time by the scheduler callback
    sinkhorn_eps: float = 1e-6
    sinkhorn_exact_axis: ExactAxis = "rows"  # rows = DeepSeek/paper, cols = Liger/lucidrains
    sinkhorn_start: SinkhornStart = "softmax_eps"
    res_layout: ResLayout = "src_dst"  # how the n^2 res logits are indexed
    alpha_init: float = 0.01  # gates alpha_pre/post/res (mHC Table 5); also HC's s_alpha, s_beta
    # home: sublayer k reads stream k mod n (pre logits +-pre_gap), writes every stream (H_post = 1) and mixes with
    # H_res ~ I (res logits res_gap * I): a pre-norm residual at t = 0 whose streams can still part (docs/design.md §6)
    bias_init: BiasInit = "home"
    res_gap: float = 6.0  # diagonal logit gap of H_res under bias_init=home; chosen by measurement (docs/design.md §6)
    pre_gap: float = 3.0  # +-logit of the home stream's H_pre under bias_init=home
    phi_init: PhiInit = "zeros"
    phi_std: float = 0.02
    post_mult: float = 2.0
    pre_eps: float = 1e-6
    hc_dynamic: bool = True  # False = static HC
    hc_tanh: bool = True
    collapse: Collapse = "sum"
    kernel_backend: KernelBackend = "auto"
    # Run consecutive mHC sublayers as one chain through the fused boundary op (post/res of l with the coefficients
    # and input of l + 1). auto: the chain where that op is the fused kernels' in eager mode (CUDA), one sublayer at a
    # time elsewhere and under torch.compile. The chain's host time per sublayer is lower, so a slow host no longer
    # holds back the eager step (docs/benchmarks.md, "Host time").
    chain_sublayers: Union[bool, Literal["auto"]] = "auto"
    # Run an init that keeps the streams identical anyway (the degenerate baseline); refused otherwise.
    allow_identical_streams: bool = False
    # Multi-stream modes, training in eager mode: each branch's pre-norm does not keep its input u = H^pre x_l (C per
    # token in the branch's dtype, fp32 under bf16-mixed) until the backward, which gets it back bitwise from the
    # stream the ops keep anyway (the fused write-back's backward writes it: C more values per token per sublayer
    # written; docs/design.md §9, model/branch_input.py). Not with recompute_block or model.compile (refused).
    rebuild_branch_input: bool = False

    def __post_init__(self) -> None:
        spec(self.residual_mode)
        _one_of("chain_sublayers", self.chain_sublayers, (True, False, "auto"))
        _at_least("n_streams", self.n_streams, 1)
        _at_least("sinkhorn_iters", self.sinkhorn_iters, 1)
        _at_least("sinkhorn_eps", self.sinkhorn_eps, 0.0)
        _one_of("sinkhorn_exact_axis", self.sinkhorn_exact_axis, EXACT_AXES)
        _one_of("sinkhorn_start", self.sinkhorn_start, STARTS)
        _one_of("res_layout", self.res_layout, RES_LAYOUTS)
        _one_of("bias_init", self.bias_init, BIAS_INITS)
        _one_of("phi_init", self.phi_init, PHI_INITS)
        _one_of("collapse", self.collapse, COLLAPSES)
        _one_of("kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
        _at_least("res_gap", self.res_gap, 0.0)
        _at_least("pre_gap", self.pre_gap, 0.0)
        _one_of("rebuild_branch_input", self.rebuild_branch_input, (True, False))
        mode = self.spec
        allowed = mode.allowed_streams()
        if allowed is not None:
            _one_of(f"n_streams for residual_mode={mode.name}", self.n_streams, allowed)
        if not mode.fused and self.kernel_backend == "triton":
            raise ValueError(
                f"kernel_backend=triton has no kernels for residual_mode={mode.name} (its "
                "ops run as torch reference ops); set kernel_backend to one of ['auto', 'torch']"
            )
        if self.identical_streams and not self.allow_identical_streams:
            raise ValueError(
                f"bias_init={self.bias_init} with phi_init=zeros keeps all {self.n_streams} streams identical for the "
                f"whole run ({self.residual_mode} becomes a residual net with scalar gates); set bias_init to one of "
                "['home', 'a6', 'hc_identity'] or phi_init to one of ['normal', 'xavier'], or set "
                "allow_identical_streams=true to run this degenerate baseline anyway"
            )

    @property
    def spec(self) -> ModeSpec:
        """What residual_mode is and does (model/modes.py)."""
        return spec(self.residual_mode)

    @property
    def identical_streams(self) -> bool:
        """True when nothing in the init tells the streams apart, so they stay equal forever (docs/design.md §6):
        a multi-stream mHC / identity-HC / mHC-lite / KromHC with phi = 0 and biases that treat every stream alike."""
        return (
            self.spec.parameters == "phi"
            and self.n_streams > 1
            and self.phi_init == "zeros"
            and self.bias_init in SYMMETRIC_BIAS_INITS
        )

    @property
    def ops_backend(self) -> KernelBackend:
        """The kernel_backend the sublayers' ops run on: the exact families have no fused kernels, so theirs is always
        the torch reference, whatever kernel_backend says (auto would pick the fused ops on CUDA)."""
        return self.kernel_backend if self.spec.fused else "torch"

    @property
    def streams(self) -> int:
        return self.n_streams if self.spec.multi_stream else 1


@dataclass
class GPTConfig:
    """GPT-style decoder: byte tokens, RoPE attention, SwiGLU MLP, RMSNorm pre-norm.

    n_layers counts blocks; each block has two sublayers (attention, MLP), so L = 2 * n_layers.
    stream_dtype: dtype of the residual stream (all n streams), set where it is created from the embedding.
        auto = bf16 when bf16 autocast is on for the device (Lightning's bf16-mixed, as the paper keeps it),
        else the embedding's dtype (fp32 under 16-mixed: fp16's range is too narrow for an unconstrained HC
        stream); float32 / bfloat16 / float16 force it. The coefficient
        maths stays fp32 either way, and the collapsed stream goes back to the embedding's dtype before the
        final norm and LM head. Applies to every residual_mode, residual included.
    recompute_block: selective recompute of the mHC ops over blocks of this many sublayers (docs/design.md §9,
        model/recompute.py), training only. 0 = off; auto = L_r* of §9 for L = n_sublayers and n = n_streams.
        residual_mode=residual has no mHC ops and never recomputes.
    """

    vocab_size: int = 256
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    context: int = 128
    mlp_ratio: float = 8 / 3
    tied_head: bool = True
    norm_eps: float = 1e-6
    rope_base: float = 10000.0
    init_std: float = 0.02
    hyper: HyperConfig = field(default_factory=HyperConfig)
    stream_dtype: StreamDtype = "auto"
    recompute_block: Union[int, Literal["auto"]] = 0

    def __post_init__(self) -> None:
        if isinstance(self.hyper, dict):
            self.hyper = HyperConfig(**self.hyper)
        _one_of("stream_dtype", self.stream_dtype, STREAM_DTYPES)
        rb = self.recompute_block
        if rb != "auto" and (isinstance(rb, bool) or not isinstance(rb, int) or rb < 0):
            raise ValueError(f"recompute_block must be 'auto' or an int >= 0 (0 = off), got {rb!r}")
        if rb != 0 and self.hyper.rebuild_branch_input and self.hyper.spec.multi_stream:
            raise ValueError(
                f"recompute_block={rb!r} with hyper.rebuild_branch_input=true is refused: the recompute "
                "drops the branch's input already; set recompute_block to 0 or rebuild_branch_input to "
                "false"
            )
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "context"):
            _at_least(name, getattr(self, name), 1)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model must be divisible by n_heads, got d_model={self.d_model}, n_heads={self.n_heads}"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"head size d_model/n_heads must be even for RoPE, got {self.d_model // self.n_heads}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")

    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_layers
