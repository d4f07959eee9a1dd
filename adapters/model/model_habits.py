"""The module work behind a PyTorch user's first habits on a model: casting parameters in place, reading the
embedding and output matrices in Hugging Face layout, resizing the vocabulary, and checking that
``gradient_checkpointing`` can apply.

The facade (``torchlike.modeling``) keeps the habits' ``transformers`` signatures; this module touches the Tunix NNX
module and its family table.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from ..families import Family
from ..training.train_step import rematerialised
from .nnx_state import flat_variables
from .tunix_model import build_abstract_model, export_plan, load_weights, materialize_hf_tensor

#: The Hugging Face names of the input embedding and of the untied output head (``nn.Embedding`` / ``nn.Linear``).
INPUT_EMBEDDING = "model.embed_tokens.weight"
OUTPUT_EMBEDDING = "lm_head.weight"

#: ``transformers``' scale of the old rows' covariance when it samples new rows (``mean_resizing=True``).
MEAN_RESIZING_COVARIANCE_SCALE = 1e-9


def cast_parameters(family: Family, hf_config, modules: Sequence[nnx.Module], dtype) -> None:
    """Casts ``modules`` to ``dtype`` in place, as ``torch.nn.Module.to(dtype)``, so they compute as the family's
    module built at ``dtype`` does (``from_pretrained(..., dtype=dtype)``).

    Every floating-point parameter is cast (integer arrays are kept; an array shared by several modules, a LoRA
    model and its base, is cast once and stays shared; each keeps its sharding), and each submodule takes the
    static dtype settings (``dtype``, ``param_dtype``, and the dtype fields of its ``config``) of the submodule at
    the same path in the family's module for ``dtype``.
    """
    target = np.dtype(dtype)
    cast: dict[int, jax.Array] = {}
    for module in modules:
        for variable in flat_variables(module).values():
            value = variable.get_value()
            if not isinstance(value, jax.Array) or not jnp.issubdtype(value.dtype, jnp.floating):
                continue
            if value.dtype != target:
                variable.set_value(cast.setdefault(id(value), value.astype(target)))
        _take_dtype_settings(module, build_abstract_model(family, hf_config, target))


def _take_dtype_settings(module: nnx.Module, reference: nnx.Module) -> None:
    """Copies the static dtype settings of ``reference``'s submodules onto ``module``'s at the same paths."""
    references = dict(nnx.iter_modules(reference))
    replaced_configs: dict[int, object] = {}  # a config several submodules share stays shared
    for path, child in nnx.iter_modules(module):
        source = references.get(path)
        if source is None:
            continue
        for name in ("dtype", "param_dtype"):
            if hasattr(child, name) and hasattr(source, name):
                setattr(child, name, getattr(source, name))
        config, source_config = getattr(child, "config", None), getattr(source, "config", None)
        if dataclasses.is_dataclass(config) and type(config) is type(source_config):
            if id(config) not in replaced_configs:
                changes = {field.name: getattr(source_config, field.name) for field in dataclasses.fields(config)
                           if _is_dtype(getattr(source_config, field.name))}
                replaced_configs[id(config)] = dataclasses.replace(config, **changes)
            child.config = replaced_configs[id(config)]


def _is_dtype(value) -> bool:
    try:
        return isinstance(value, np.dtype | type) and jnp.issubdtype(value, jnp.floating)
    except TypeError:
        return False


def has_quantized_parameters(module: nnx.Module) -> bool:
    """Whether ``module`` holds quantised weights (Qwix's integer ``qvalue`` arrays under QLoRA): the Tunix models'
    own parameters are all floating-point."""
    return any(not jnp.issubdtype(variable.get_value().dtype, jnp.floating)
               for variable in flat_variables(module).values())


def hf_weight(family: Family, module: nnx.Module, hf_name: str) -> jax.Array | None:
    """The parameter Hugging Face calls ``hf_name``, in Hugging Face's layout (``(vocab, hidden)`` for the embedding
    and the head), on its devices; ``None`` when the module has no such parameter (a tied head)."""
    _, sources = export_plan(family, module)
    if hf_name not in sources:
        return None
    array, rule = sources[hf_name]
    if rule.stack is not None:
        raise ValueError(f"{hf_name} is one part of the stacked parameter {rule.nnx}; read it with state_dict().")
    return rule.layout.to_hf(array) if rule.layout.moves_axes else array


def resized_rows(matrix: np.ndarray, rows: int, mean_resizing: bool, initializer_range: float,
                 rng: np.random.Generator) -> np.ndarray:
    """``matrix`` (``(old rows, hidden)``) cut or extended to ``rows`` rows, as ``transformers``'
    ``_get_resized_embeddings`` and ``_get_resized_lm_head`` do.

    New rows, with ``mean_resizing``, are drawn from a normal with the old rows' mean and ``1e-9`` times their
    covariance (``_init_added_embeddings_weights_with_mean``: the mean plus noise far below the rows' spread), or
    are the mean itself when that covariance is not positive definite; without it they are drawn from
    ``normal(0, initializer_range)``. Statistics are computed in float32 and the result has ``matrix``'s dtype.
    """
    old_rows = matrix.shape[0]
    if rows <= old_rows:
        return matrix[:rows]
    added = rows - old_rows
    if not mean_resizing:
        extra = rng.normal(0.0, initializer_range, (added, matrix.shape[1]))
        return np.concatenate([matrix, extra.astype(matrix.dtype)])
    old = matrix.astype(np.float32)
    mean = old.mean(axis=0)
    centered = old - mean
    covariance = MEAN_RESIZING_COVARIANCE_SCALE * (centered.T @ centered / old_rows)
    try:
        factor = np.linalg.cholesky(covariance.astype(np.float64))
        extra = mean + rng.standard_normal((added, matrix.shape[1])) @ factor.T
    except np.linalg.LinAlgError:  # not positive definite: transformers falls back to the mean
        extra = np.broadcast_to(mean, (added, matrix.shape[1]))
    return np.concatenate([matrix, extra.astype(matrix.dtype)])


def resize_vocabulary(family: Family, module: nnx.Module, hf_config, rows: int, *, mean_resizing: bool = True,
                      seed: int = 0, mesh: Mesh | None = None) -> nnx.Module:
    """A new module for a vocabulary of ``rows`` tokens (``hf_config`` is left as it is; set its ``vocab_size``).

    The input embedding and an untied output head are cut or extended (:func:`resized_rows`, each from its own
    rows, as ``transformers`` resizes the head before tying); a tied head follows the embedding. Every other
    parameter is carried over unchanged. The module is rebuilt through the family table, one tensor on the host at
    a time, in the parameters' dtype and sharding; the old and the new parameters are both on the devices until the
    old module is dropped.
    """
    config = copy.deepcopy(hf_config)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    text_config.vocab_size = rows
    specs, sources = export_plan(family, module)
    dtypes = {spec.dtype for spec in specs}
    if len(dtypes) != 1:
        raise ValueError(f"resize_token_embeddings needs one parameter dtype; the model has "
                         f"{sorted(map(str, dtypes))}. Cast it first with model.to(dtype).")
    rng = np.random.default_rng(seed)
    initializer_range = float(getattr(text_config, "initializer_range", 0.02))

    def tensors() -> Iterator[tuple[str, np.ndarray, str]]:
        for spec in specs:
            array = materialize_hf_tensor(sources, spec)
            if spec.name in (INPUT_EMBEDDING, OUTPUT_EMBEDDING):
                array = resized_rows(array, rows, mean_resizing, initializer_range, rng)
            yield spec.name, array, "resize_token_embeddings"

    return load_weights(family, config, tensors(), dtypes.pop(), mesh=mesh, source="resize_token_embeddings")


def check_rematerialisable(module: nnx.Module) -> None:
    """Raises ``ValueError`` (with the reason) when ``gradient_checkpointing`` cannot apply to ``module``: it has no
    decoder layer Tunix can rematerialise. The module is left as it was."""
    with rematerialised(module):
        pass
