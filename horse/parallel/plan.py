"""``GPT_PLAN``: one table that says, per module of the GPT, how it splits over the tp ranks."""

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import nn

from horse.model import GPTConfig
from horse.parallel.mesh import Parallel
from horse.parallel.tensor_parallel import (
    column_parallel,
    experts_inter_parallel,
    row_parallel,
    vocab_parallel,
    vocab_parallel_head,
)


@dataclass(frozen=True)
class Style:
    """One row of a tensor-parallel plan: how a module splits over the tp ranks.

    split: what of the module is cut. "rows": its weight and bias, by output rows (dim 0);
        "columns": its weight, by input columns (dim 1), while its bias (added once, after the
        ranks' partial outputs are summed) stays whole on every rank; "heads": its head counts
        (n_heads, n_kv_heads), divided by tp; "inter": the hidden units of every expert of a
        mixture of experts (``horse.layers.MoEExperts``), gate_up_proj (experts, 2·inter, C) by its
        rows (dim 1) and down_proj (experts, C, inter) by its columns (dim 2); None: nothing (its
        parameters whole on every rank)
    sections: the consecutive sections of the cut dim that are cut separately, from the model's
        config: each rank takes its 1/tp of every section, in order (c_attn's q, k and v rows);
        None: the dim is cut as one
    sectioned: the parameters whose cut dim has those sections (the others are cut as one)
    form: the module's tensor-parallel form (``horse.parallel.tensor_parallel``), a function
        ``form(module, parallel)`` that hooks the collectives onto the module, or returns the module
        that takes its place; None: the module runs as it is, its parent handing it what it needs
    """

    split: Literal["rows", "columns", "heads", "inter"] | None = None
    sections: Callable[[GPTConfig], list[int]] | None = None
    sectioned: tuple[str, ...] = ("weight", "bias")
    form: Callable[[nn.Module, Parallel], nn.Module] | None = None

    def dim_of(self, param: str) -> int | None:
        """The dim along which the module's parameter ``param`` ("weight", "bias", "gate_up_proj", ...)
        is cut; None: whole."""
        if self.split == "rows" and param in ("weight", "bias"):
            return 0
        if self.split == "columns" and param == "weight":
            return 1
        if self.split == "inter":
            return {"gate_up_proj": 1, "down_proj": 2}.get(param)
        return None

    def sections_of(self, param: str, config: GPTConfig) -> list[int] | None:
        """The sections of the module's parameter ``param``'s cut dim; None: cut as one."""
        if self.sections is None or param not in self.sectioned:
            return None
        return self.sections(config)


def qkv_sections(config: GPTConfig) -> list[int]:
    """c_attn's output rows, in order: the query heads', the key heads', the value heads'."""
    q_rows = config.n_head * config.head_dim
    kv_rows = config.kv_heads * config.head_dim
    return [q_rows, kv_rows, kv_rows]


def gate_up_sections(config: GPTConfig) -> list[int]:
    """The experts' gate_up_proj rows (dim 1), in order: the gate's, the up projection's."""
    return [config.expert_hidden, config.expert_hidden]


# The GPT's plan, Megatron's. Attention is split by heads and the MLP by hidden units; each branch
# opens column-parallel (the whole input on every rank, each computing its own output rows) and
# closes row-parallel (the ranks' partial outputs summed: one all-reduce per branch forward, one
# per backward). The token embedding, which is also the LM head, is split by vocabulary rows.
# Keys are module names as ``named_modules`` gives them ("" the GPT itself; "*" one component of a
# name: a block's index). A module not listed keeps its parameters whole on every rank (the norms,
# the position table). ``parallelize`` applies the plan to a model; ``shard_spec`` reads it to cut
# and gather state dicts and checkpoints.
GPT_PLAN: dict[str, Style] = {
    "": Style(form=vocab_parallel_head),  # the LM head and the loss on vocabulary shards
    "wte": Style("rows", form=vocab_parallel),
    "lm_head": Style("rows"),  # LLaMA's own head: never called, read by the GPT's head and loss
    "blocks.*.attn": Style("heads"),
    "blocks.*.attn.c_attn": Style("rows", sections=qkv_sections, form=column_parallel),
    "blocks.*.attn.c_proj": Style("columns", form=row_parallel),
    "blocks.*.mlp": Style(form=column_parallel),  # takes its input whole once, for the up projections
    "blocks.*.mlp.c_fc": Style("rows"),
    "blocks.*.mlp.gate_proj": Style("rows"),
    "blocks.*.mlp.up_proj": Style("rows"),
    "blocks.*.mlp.c_proj": Style("columns", form=row_parallel),
    "blocks.*.mlp.down_proj": Style("columns", form=row_parallel),
    # A mixture of experts in the MLP's place: its router (gate) whole on every rank, each expert split
    # by hidden units as the MLP is (gate_up by rows, down by columns: one all-reduce).
    "blocks.*.moe.experts": Style(
        "inter", sections=gate_up_sections, sectioned=("gate_up_proj",), form=experts_inter_parallel
    ),
}


@functools.cache
def _name_pattern(key: str) -> re.Pattern:
    """A plan key as a regular expression: "*" matches one component of a name, and any prefix that
    ends in "." is allowed, so that a wrapper's (DDP's "module.", torch.compile's "_orig_mod.")
    does not hide the name."""
    components = ["[^.]+" if part == "*" else re.escape(part) for part in key.split(".")]
    return re.compile(r"(?:.*\.)?" + r"\.".join(components))


def style_of(module_name: str) -> Style | None:
    """GPT_PLAN's row for the module ``module_name``; None: the module is not split."""
    for key, style in GPT_PLAN.items():
        if _name_pattern(key).fullmatch(module_name):
            return style
    return None
