"""AdamW with 8-bit block-wise states: the memory of bitsandbytes' `AdamW8bit` (whole
parameters) or torchao's (FSDP2's sharded ones), which cannot run on this CPU-only build, as an
explicit allowance (docs/design.md#weights-and-optimizer-states).

Which library is measured when, and the states each keeps, is
`autotune.core.memory.optimizer_states`; this optimizer allocates those states on a parameter,
or on a rank's shard of a DTensor parameter as torchao does.

The update is AdamW over dequantised states, requantised by block absmax through a power-law
map (the libraries use their dynamic quantisation maps: the same bytes, other values). They do
it in one fused kernel with no temporaries; this one works on chunks of `CHUNK_ELEMENTS`
elements, whose fp32 temporaries (about 8 MiB during the optimizer step) are the allowance's
only excess over the real libraries. It reads no tensor value on the host, so the estimate
traces it on fake tensors, where only a parameter's first and last chunks are traced: every
chunk allocates and frees the same temporaries, so the peak is the same, and the 30 000 chunks
of an 8B model would take minutes of tracing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from autotune.core.memory.optimizer_states import (
    BLOCK_ELEMENTS,
    QMAP_ENTRIES,
    Library,
    is_8bit,
)

# A multiple of the block; 2^18 fp32 elements are 1 MiB per temporary.
CHUNK_ELEMENTS = 2**18
_SIGNED_LEVELS = 127.0
_UNSIGNED_LEVELS = 255.0
# Codes are companded (value = code^power): small moments keep resolution, as bitsandbytes'
# dynamic map keeps it; a linear map rounds small second moments to 0 and the update explodes.
_SIGNED_POWER = 2.0
_UNSIGNED_POWER = 4.0


def assumption(library: Library) -> str:
    """What a result measured with this allowance states."""
    if library is Library.BITSANDBYTES:
        sizes = "uint8 moments, fp32 absmax per 256 elements, fp32 under 4096 elements"
    else:
        sizes = (
            "per rank's shard: uint8 moments, an fp32 scale per 256 elements and a 256-entry "
            "map each; in the parameter's dtype under 4096 elements or off the 256 blocks"
        )
    return (
        f"adamw8bit: {library}'s AdamW8bit state sizes ({sizes}), allocated by autotune's "
        "stand-in; the library itself did not run"
    )


class AdamW8bit(torch.optim.Optimizer):
    """AdamW keeping `library`'s `AdamW8bit` state tensors (see the module docstring)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        library: Library = Library.BITSANDBYTES,
    ) -> None:
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )
        self.library = library
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, but the states keep their dtypes: torch casts every state tensor to its
        parameter's dtype (uint8 codes and fp32 absmax included)."""
        super().load_state_dict({**state_dict, "state": {}})
        params = [param for group in self.param_groups for param in group["params"]]
        for index, saved in state_dict["state"].items():
            param = params[index]
            self.state[param] = {
                key: value.to(param.device, copy=True)
                if isinstance(value, torch.Tensor)
                else value
                for key, value in saved.items()
            }

    def _maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._qmaps is None or self._qmaps[0].device != device:
            self._qmaps = _qmaps(device)
        return self._qmaps

    def _init_state(self, param: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = self.state[param]
        state["step"] = 0
        local = _local(param)  # a rank's shard of a DTensor, as torchao keeps its states
        if not is_8bit(local.numel(), self.library):
            # bitsandbytes keeps fp32 states, torchao states of the parameter's dtype.
            dtype = torch.float32 if self.library is Library.BITSANDBYTES else local.dtype
            state["exp_avg"] = torch.zeros_like(local, dtype=dtype)
            state["exp_avg_sq"] = torch.zeros_like(local, dtype=dtype)
            return state
        blocks = -(-local.numel() // BLOCK_ELEMENTS)
        # Signed state stored with an offset of 128: uint8 as bitsandbytes stores it.
        state["state1"] = torch.full_like(local, 128, dtype=torch.uint8)
        state["state2"] = torch.zeros_like(local, dtype=torch.uint8)
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=local.device)
        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=local.device)
        if self.library is Library.BITSANDBYTES:
            self._maps(local.device)  # shared by all parameters
        else:  # each of torchao's states holds its own map
            state["qmap1"], state["qmap2"] = _qmaps(local.device)
        return state

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("AdamW8bit takes no closure")
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param] or self._init_state(param)
                state["step"] += 1
                if "exp_avg" in state:
                    self._update_fp32(param, state, group)
                else:
                    self._update_8bit(param, state, group)

    def _update_fp32(
        self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        assert param.grad is not None
        local, grad = _local(param), _local(param.grad)
        exp_avg, exp_avg_sq = state["exp_avg"].float(), state["exp_avg_sq"].float()
        update = _adamw_update(exp_avg, exp_avg_sq, grad.float(), state["step"], group)
        if exp_avg is not state["exp_avg"]:  # states of a bf16 parameter (torchao's)
            state["exp_avg"].copy_(exp_avg)
            state["exp_avg_sq"].copy_(exp_avg_sq)
        _apply(local.view(-1), update.view(-1), local.view(-1).float(), group)

    def _update_8bit(
        self, param: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        assert param.grad is not None
        flat_param, flat_grad = _local(param).view(-1), _local(param.grad).view(-1)
        state1, state2 = state["state1"].view(-1), state["state2"].view(-1)
        numel = flat_param.numel()
        starts = range(0, numel, CHUNK_ELEMENTS)
        if is_fake(flat_param) and len(starts) > 2:
            starts = range(0, numel, CHUNK_ELEMENTS * (len(starts) - 1))
        for start in starts:
            end = min(start + CHUNK_ELEMENTS, numel)
            first_block, last_block = start // BLOCK_ELEMENTS, -(-end // BLOCK_ELEMENTS)
            absmax1 = state["absmax1"][first_block:last_block]
            absmax2 = state["absmax2"][first_block:last_block]
            exp_avg = _dequantise(state1[start:end], absmax1, signed=True)
            exp_avg_sq = _dequantise(state2[start:end], absmax2, signed=False)
            update = _adamw_update(
                exp_avg, exp_avg_sq, flat_grad[start:end].float(), state["step"], group
            )
            _apply(flat_param[start:end], update, flat_param[start:end].float(), group)
            _quantise(exp_avg, state1[start:end], absmax1, signed=True)
            _quantise(exp_avg_sq, state2[start:end], absmax2, signed=False)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view: updating it updates the parameter), else the
    tensor."""
    if isinstance(tensor, DTensor):
        local: torch.Tensor = tensor.to_local()
        return local
    return tensor


def _qmaps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The signed and unsigned quantisation maps: 256 fp32 values each."""
    return (
        torch.linspace(-1.0, 1.0, QMAP_ENTRIES, device=device),
        torch.linspace(0.0, 1.0, QMAP_ENTRIES, device=device),
    )


def _adamw_update(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    step: int,
    group: dict[str, Any],
) -> torch.Tensor:
    """Updates the fp32 moments in place; returns the step's Adam direction."""
    beta1, beta2 = group["betas"]
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    denominator = (exp_avg_sq / bias2).sqrt_().add_(group["eps"])
    direction: torch.Tensor = (exp_avg / bias1).div_(denominator)
    return direction


def _apply(
    param: torch.Tensor, update: torch.Tensor, param_fp32: torch.Tensor, group: dict[str, Any]
) -> None:
    param_fp32.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
    param.copy_(param_fp32)


def _blocks(values: torch.Tensor) -> torch.Tensor:
    """`values` as rows of one block each, the last one zero-padded."""
    padding = (-values.numel()) % BLOCK_ELEMENTS
    if padding:
        values = torch.nn.functional.pad(values, (0, padding))
    return values.view(-1, BLOCK_ELEMENTS)


def _dequantise(codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool) -> torch.Tensor:
    values = codes.float()
    if signed:
        values = values.sub_(128.0).div_(_SIGNED_LEVELS)
        values = values.abs().pow_(_SIGNED_POWER).mul_(values.sign())
    else:
        values = values.div_(_UNSIGNED_LEVELS).pow_(_UNSIGNED_POWER)
    rows = _blocks(values).mul_(absmax.unsqueeze(1))
    return rows.view(-1)[: codes.numel()]


def _quantise(
    values: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool
) -> None:
    rows = _blocks(values)
    absmax.copy_(rows.abs().amax(dim=1))
    scale = absmax.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(1)
    scaled = rows / scale
    if signed:
        scaled = scaled.abs().pow_(1 / _SIGNED_POWER).mul_(_SIGNED_LEVELS).round_()
        scaled.mul_(rows.sign()).add_(128.0)
    else:
        scaled = scaled.pow_(1 / _UNSIGNED_POWER).mul_(_UNSIGNED_LEVELS).round_()
    codes.copy_(scaled.view(-1)[: codes.numel()].to(torch.uint8))
