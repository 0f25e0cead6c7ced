"""CUDA's autocast op lists in torch 2.13: which ops cast to the autocast dtype, which to fp32.

Transcribed from ATen's `AT_FORALL_*` autocast macros (read in the 2.13.0 wheel) as ATen's
`TORCH_LIBRARY_IMPL(aten, Autocast, m)` block applies them, plus that block's cudnn convolutions
and banned binary_cross_entropy (docs/design.md#autocast-on-the-emulated-gpu). A test checks the
set of ops against the binary's `AutocastCUDA` registrations; `autotune.engine.emulation.autocast`
applies the lists on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum


class CastPolicy(StrEnum):
    """torch's `at::autocast::CastPolicy`, plus the banned op."""

    LOWER_PRECISION_FP = "lower_precision_fp"  # floating inputs to the autocast dtype
    FP32 = "fp32"  # floating inputs to fp32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # output dtype fp32 unless the caller set one
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatch to the overload that takes a dtype
    PROMOTE = "promote"  # floating inputs to the widest of them
    BANNED = "banned"  # refused under CUDA autocast


def _listed(policy: CastPolicy, *names: str) -> dict[str, CastPolicy]:
    return dict.fromkeys(names, policy)


# Names are "op.overload" as the dispatcher spells them (no suffix for the default overload).
CUDA_POLICY: Mapping[str, CastPolicy] = {
    **_listed(
        CastPolicy.LOWER_PRECISION_FP,
        "_convolution.deprecated",
        "_convolution",
        "conv1d",
        "conv2d",
        "conv3d",
        "conv_tbc",
        "conv_transpose1d",
        "conv_transpose2d.input",
        "conv_transpose3d.input",
        "convolution",
        "prelu",
        "addmm",
        "addmv",
        "addr",
        "matmul",
        "einsum",
        "mm",
        "mv",
        "linalg_vecdot",
        "linear",
        "addbmm",
        "baddbmm",
        "bmm",
        "chain_matmul",
        "linalg_multi_dot",
        "_thnn_fused_lstm_cell",
        "_thnn_fused_gru_cell",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
        "_scaled_dot_product_flash_attention",
        "scaled_dot_product_attention",
        "cudnn_convolution",
        "cudnn_convolution_transpose",
    ),
    **_listed(
        CastPolicy.FP32,
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow.Tensor_Scalar",
        "pow.Tensor_Tensor",
        "pow.Scalar",
        "softplus",
        "layer_norm",
        "native_layer_norm",
        "rms_norm",
        "group_norm",
        "frobenius_norm.dim",
        "nuclear_norm",
        "nuclear_norm.dim",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "upsample_nearest1d",
        "_upsample_nearest_exact1d",
        "upsample_nearest2d",
        "_upsample_nearest_exact2d",
        "upsample_nearest3d",
        "_upsample_nearest_exact3d",
        "upsample_linear1d",
        "upsample_bilinear2d",
        "_upsample_bilinear2d_aa",
        "upsample_trilinear3d",
        "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
    ),
    **_listed(
        CastPolicy.FP32_SET_OPT_DTYPE,
        "prod",
        "prod.dim_int",
        "softmax.int",
        "log_softmax.int",
        "cumprod",
        "cumsum",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "linalg_matrix_norm.str_ord",
        "sum",
        "sum.dim_IntList",
    ),
    **_listed(CastPolicy.FP32_APPEND_DTYPE, "norm.Scalar", "norm.ScalarOpt_dim"),
    **_listed(
        CastPolicy.PROMOTE,
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "dot",
        "vdot",
        "grid_sampler",
        "index_put",
        "tensordot",
        "scatter_add",
    ),
    **_listed(CastPolicy.BANNED, "binary_cross_entropy"),
}

# fp32_append_dtype redispatches to the overload that takes the output dtype.
APPEND_DTYPE_TARGETS = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}
