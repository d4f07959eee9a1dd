"""LoRA target selection: which modules of a Tunix model PEFT's ``target_modules`` names, and PEFT's defaults.

A target is an adaptable module (a linear layer the family table names, e.g. ``q_proj``) with the HF module
names it serves: one, or several where Tunix fuses projections (Gemma 3's ``kv_einsum`` holds ``k_proj`` and
``v_proj``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flax import nnx

from ..families import Family
from ..model.nnx_state import flat_variables


@dataclass(frozen=True)
class LoraTarget:
    """One adaptable module: its NNX path (``/``-joined, as Qwix matches) and the HF module names it serves."""

    nnx_module: str
    weight: str
    hf_modules: tuple[str, ...]


def adaptable_modules(family: Family, module: nnx.Module) -> list[LoraTarget]:
    """Every linear module LoRA can target, with its HF module name(s) (``model.layers.0.self_attn.q_proj``)."""
    found: dict[str, LoraTarget] = {}
    for nnx_path in flat_variables(module):
        parent, _, weight = nnx_path.rpartition(".")
        for hf_name, _rule in family.nnx_to_hf(nnx_path):
            hf_module = hf_name.removesuffix(".weight")
            if hf_module.rsplit(".", 1)[-1] not in family.lora_targets or not hf_name.endswith(".weight"):
                continue
            if any(re.fullmatch(pattern, hf_module) for pattern in family.lora_not_linear):
                continue
            module_path = parent.replace(".", "/")
            previous = found.get(module_path)
            modules = (previous.hf_modules if previous else ()) + (hf_module,)
            found[module_path] = LoraTarget(module_path, weight, modules)
    return list(found.values())


def _named_modules(family: Family, module: nnx.Module) -> list[str]:
    """The HF modules of the table's weights in ``module`` and their parents (``model.layers``...), sorted."""
    found = set()
    for nnx_path in flat_variables(module):
        for hf_name, _rule in family.nnx_to_hf(nnx_path):
            parts = hf_name.removesuffix(".weight").split(".")
            found.update(".".join(parts[:end]) for end in range(1, len(parts) + 1))
    return sorted(found)


def _reason(patterns: dict[str, str], hf_module: str) -> str | None:
    """The reason of the first pattern of ``patterns`` (HF module regex -> reason) that ``hf_module`` matches."""
    return next((why for pattern, why in patterns.items() if re.fullmatch(pattern, hf_module)), None)


def _check_not_refused(family: Family, modules: list[str], target_modules: list[str] | str) -> None:
    """Raises when ``target_modules`` names one of ``modules`` (:func:`_named_modules`) the family refuses
    (``Family.lora_refused``), naming it and giving the reason."""
    for hf_module in modules:
        reason = _reason(family.lora_refused, hf_module)
        if target_modules == "all-linear" and _reason(family.lora_not_linear, hf_module):
            continue  # PEFT's "all-linear" leaves it out too
        if reason is not None and _names(hf_module, target_modules):
            raise ValueError(f"target_modules={target_modules!r} names {hf_module}, which LoRA cannot adapt in the "
                             f"{family.name} model: {reason}.")


def _not_linear_note(family: Family, modules: list[str], names: list[str]) -> str:
    """Why the ``modules`` (:func:`_named_modules`) that ``names`` point at cannot be adapted
    (``Family.lora_not_linear``: not ``nn.Linear`` in ``transformers``, so PEFT's ``target_modules`` never reaches
    them either), or ``""``."""
    notes = {}
    for hf_module in modules:
        reason = _reason(family.lora_not_linear, hf_module)
        if reason and _names(hf_module, names):
            notes.setdefault(reason, hf_module)
    return "".join(f" {hf_module} is not adapted: {reason}." for reason, hf_module in notes.items())


def default_target_modules(family: Family) -> list[str] | str:
    """The HF module names PEFT adapts when ``target_modules`` is ``None`` (its per-``model_type`` table).

    Raises:
        ValueError: the family has no default, naming the family and the valid names.
    """
    if not family.default_lora_targets:
        raise ValueError(f"the {family.name} family has no default LoRA target_modules; set "
                         f"LoraConfig(target_modules=...) (or --lora_target_modules) to e.g. "
                         f"{sorted(family.lora_targets)} or 'all-linear'.")
    if isinstance(family.default_lora_targets, str):
        return family.default_lora_targets  # a regex, as PEFT's table gives some model types
    return list(family.default_lora_targets)


def _names_in(family: Family, hf_module: str, target_modules: list[str] | str) -> bool:
    """:func:`_names` on the checkpoint's name of a module or on ``transformers``' in-memory one (PEFT matches the
    names of the model in memory: ``.*language_model.*`` reaches Qwen2.5-VL's decoder, saved as ``model.layers``)."""
    return _names(hf_module, target_modules) or _names(family.in_memory_name(hf_module), target_modules)


def _names(hf_module: str, target_modules: list[str] | str) -> bool:
    """Whether PEFT's ``target_modules`` names ``hf_module``: a listed name equals it or is its last
    dotted part(s); a string is a regex matched against the full name."""
    if isinstance(target_modules, str):
        return target_modules == "all-linear" or re.fullmatch(target_modules, hf_module) is not None
    return any(hf_module == name or hf_module.endswith("." + name) for name in target_modules)


def select_targets(family: Family, module: nnx.Module, target_modules) -> list[LoraTarget]:
    """The modules PEFT would adapt for ``target_modules``.

    Args:
        target_modules: a list of HF module names (a module matches when its name equals an
            entry or ends with ``"." + entry``), a regex string (``re.fullmatch`` on the full HF
            module name), ``"all-linear"`` (every linear layer except the LM head), or ``None``
            (the family's :func:`default_target_modules`).

    Raises:
        ValueError: nothing matched, naming the valid module names; ``target_modules`` names a module the family
            refuses (``Family.lora_refused``), with the reason; or ``"all-linear"`` where the family refuses it
            (``Family.all_linear_refused``).
    """
    if target_modules is None:
        target_modules = default_target_modules(family)
    if target_modules == "all-linear" and family.all_linear_refused:
        raise ValueError(f"target_modules='all-linear' is not supported for the {family.name} model: "
                         f"{family.all_linear_refused}. Name the modules to adapt instead, e.g. "
                         f"{sorted(family.lora_targets)}.")
    modules = _named_modules(family, module) if family.lora_refused or family.lora_not_linear else []
    _check_not_refused(family, modules, target_modules)
    candidates = adaptable_modules(family, module)
    known = sorted(family.lora_targets)
    if not isinstance(target_modules, str):
        # A name reaching only modules that are not linear in transformers is skipped, as PEFT skips it.
        unknown = [n for n in target_modules if not any(_names_in(family, m, [n]) for t in candidates
                                                         for m in t.hf_modules)
                   and not _not_linear_note(family, modules, [n])]
        if unknown:
            raise ValueError(f"target_modules {unknown} match no module of this {family.name} model; valid names: "
                             f"{known} (or full names like 'model.layers.0.self_attn.q_proj', a regex, 'all-linear').")
    chosen = [t for t in candidates if any(_names_in(family, m, target_modules) for m in t.hf_modules)]
    if not chosen:
        named = [target_modules] if isinstance(target_modules, str) else list(target_modules)
        raise ValueError(f"target_modules={target_modules!r} matches no module; valid names: {known}."
                         f"{_not_linear_note(family, modules, named)}")
    return chosen


def unnamed_fused_modules(targets: list[LoraTarget], target_modules: list[str] | str) -> list[str]:
    """The HF modules that ``targets`` adapt although ``target_modules`` does not name them: partners the
    Tunix model fuses with a named module into one (Gemma 3's ``k_proj``/``v_proj`` share ``kv_einsum``),
    so one LoRA pair serves both.

    Returns:
        Sorted names. For a list, each is spelled like the entry that named its partner (``"k_proj"``
        beside ``"v_proj"``, a full name beside a full name), so adding them names exactly these
        modules; for a regex, full module names.
    """
    found = set()
    for target in targets:
        named = [m for m in target.hf_modules if _names(m, target_modules)]
        for module in target.hf_modules:
            if module in named:
                continue
            if isinstance(target_modules, str):
                found.add(module)
                continue
            entry = next(n for n in target_modules if _names(named[0], [n]))
            found.add(".".join(module.split(".")[-len(entry.split(".")):]))
    return sorted(found)
