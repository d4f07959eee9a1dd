"""The import rules of ARCHITECTURE.md, read from the source: the facade imports no backend, ``adapters/`` never
imports the facade, no module of either imports itself through a cycle, no private name is imported across modules
(in the package or the tests), and no module imports a test module (imports inside functions count too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("tunix", "qwix", "orbax", "safetensors")
#: The top-level packages whose private names are this project's to keep private.
PROJECT = ("torchlike", "tests")


def module_files() -> dict[str, Path]:
    """Every module of the package by its installed name (``adapters/`` installs as ``torchlike.adapters``)."""
    modules = {}
    for folder, package in (("torchlike", "torchlike"), ("adapters", "torchlike.adapters")):
        for path in (ROOT / folder).rglob("*.py"):
            parts = [part for part in path.relative_to(ROOT / folder).with_suffix("").parts if part != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """The absolute names ``module`` imports anywhere in its source (``from x import y`` gives ``x.y``)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            names.update(f"{prefix}.{alias.name}" for alias in node.names)
    return names


def project_files() -> dict[str, Path]:
    """:func:`module_files` and the test suite's modules (``tests/`` is the package ``tests``)."""
    modules = module_files()
    for path in (ROOT / "tests").rglob("*.py"):
        modules[".".join(part for part in path.relative_to(ROOT).with_suffix("").parts if part != "__init__")] = path
    return modules


def is_private(name: str) -> bool:
    """A name with one leading underscore (dunders like ``__version__`` are public)."""
    return name.startswith("_") and not name.startswith("__")


def private_imports(module: str, path: Path) -> set[str]:
    """The project names ``module`` imports through a private part: ``from x import _name``, ``from x import _mod``,
    ``from x._mod import name``, ``import x._mod``. Third-party privates (``trl``'s) are not this project's to fix."""
    return {name for name in imported_names(module, path)
            if name.split(".")[0] in PROJECT and any(is_private(part) for part in name.split(".")[1:])}


def is_test_module(name: str) -> bool:
    """Whether ``name`` is a test module (``tests/test_*.py``) or a name inside one."""
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == "tests" and parts[1].startswith("test_")


def imported_test_modules(module: str, path: Path) -> set[str]:
    """The test modules other than itself that ``module`` imports from."""
    return {".".join(name.split(".")[:2]) for name in imported_names(module, path)
            if is_test_module(name) and name.split(".")[:2] != module.split(".")[:2]}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (a name resolves to its longest prefix that is a module)."""
    modules = module_files()
    graph = {}
    for module, path in modules.items():
        targets = set()
        for name in imported_names(module, path):
            while name and name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def is_adapter(module: str) -> bool:
    return module == "torchlike.adapters" or module.startswith("torchlike.adapters.")


def test_the_facade_imports_no_backend():
    crossings = sorted((module, name) for module, path in module_files().items() if not is_adapter(module)
                       for name in imported_names(module, path) if name.split(".")[0] in BACKENDS)
    assert crossings == [], f"facade modules importing a backend (move the code to adapters/): {crossings}"


def test_adapters_never_import_the_facade():
    crossings = sorted((module, target) for module, targets in import_graph().items() if is_adapter(module)
                       for target in targets if not is_adapter(target))
    assert crossings == [], f"adapters importing the facade (pass what they need as arguments): {crossings}"


def test_no_module_imports_itself_through_a_cycle():
    assert cycles(import_graph()) == []


def test_the_checks_see_a_cycle_and_resolve_relative_imports(tmp_path):
    """The helpers above catch what they are meant to, on a made-up graph and a made-up module."""
    graph = {"torchlike.a": {"torchlike.b"}, "torchlike.b": {"torchlike.a"}, "torchlike.adapters.c": set()}
    assert cycles(graph) == [["torchlike.a", "torchlike.b"]]
    source = tmp_path / "runtime.py"
    source.write_text("import tunix.models\nfrom ..model.nnx_state import flat\n\ndef f():\n    from . import merge\n")
    assert imported_names("torchlike.adapters.lora.runtime", source) == {
        "tunix.models", "torchlike.adapters.model.nnx_state.flat", "torchlike.adapters.lora.merge"}


def test_no_private_name_is_imported_across_modules():
    crossings = sorted((module, name) for module, path in project_files().items()
                       for name in private_imports(module, path))
    assert crossings == [], ("private names imported from another module (give the shared helper a public name in "
                             f"the room whose job it is): {crossings}")


def test_the_private_import_check_fires_on_a_made_up_module(tmp_path):
    source = tmp_path / "made_up.py"
    source.write_text("from torchlike.trl.data.sft_data import _columns, columns\nfrom ._shared import helper\n"
                      "import torchlike.adapters._internal\nfrom .version import __version__\n"
                      "from trl.trainer.utils import _private\n\ndef f():\n    from tests.tiny import _case\n")
    assert private_imports("torchlike.trl.made_up", source) == {
        "torchlike.trl.data.sft_data._columns", "torchlike.trl._shared.helper", "torchlike.adapters._internal",
        "tests.tiny._case"}


def test_no_module_imports_a_test_module():
    crossings = sorted((module, target) for module, path in project_files().items()
                       for target in imported_test_modules(module, path))
    assert crossings == [], ("modules importing a test module (share the helper through tests/helpers/ or a conftest "
                             f"fixture): {crossings}")


def test_the_test_import_check_fires_on_a_made_up_test_module(tmp_path):
    source = tmp_path / "test_made_up.py"
    source.write_text("from tests import tiny\nfrom tests.helpers.models import with_config\n"
                      "from tests.test_peft import randomize_lora_\nfrom . import test_gemma2\n"
                      "from .test_made_up import CASES\n\ndef f():\n    import tests.test_trainer\n")
    assert imported_test_modules("tests.test_made_up", source) == {
        "tests.test_peft", "tests.test_gemma2", "tests.test_trainer"}


def test_online_trainers_share_one_generation_path_schedule_and_scoring():
    """GRPO, RLOO and Distillation sample, call tools, score and schedule their generation batches through
    ``OnlineTrainer``; they differ in what they add to a Rollout (advantages, the divergence mask) and their loss."""
    from torchlike.trl import DistillationTrainer, GRPOTrainer, RLOOTrainer
    from torchlike.trl.trainer.online_trainer import OnlineTrainer

    path = ("_generate", "_generate_single_turn", "_custom_rollout", "_call_tools", "_new_worker",
            "_build_rollout_engine", "rollout_worker", "reward_scorer", "_generation_seed", "_generation_rows")
    schedule = ("_batches", "_steps_per_epoch", "_get_train_sampler")
    # The student-teacher loop chooses between this schedule ("generation", Distillation's) and the dataset's (GKD's).
    for trainer, shared in ((GRPOTrainer, path + schedule), (RLOOTrainer, path + schedule),
                            (DistillationTrainer, path)):
        assert [name for name in shared if getattr(trainer, name) is not getattr(OnlineTrainer, name)] == [], trainer
        assert trainer._generation_schedule is not OnlineTrainer._generation_schedule
    assert RLOOTrainer._rollout is GRPOTrainer._rollout
    # A second model samples through a rollout worker of its own handed to _generate, not by switching the policy's.
    from torchlike.trl.experimental.gkd import GKDTrainer
    from torchlike.trl.experimental.nash_md import NashMDTrainer
    from torchlike.trl.experimental.xpo import XPOTrainer

    for trainer in (NashMDTrainer, XPOTrainer, GKDTrainer):
        path = ("_generate", "_generate_single_turn", "rollout_engine", "rollout_worker", "reward_scorer")
        assert [name for name in path if getattr(trainer, name) is not getattr(OnlineTrainer, name)] == [], trainer
    assert {RLOOTrainer.algorithm_class.advantages, RLOOTrainer.algorithm_class.step_loss}.isdisjoint(
        {GRPOTrainer.algorithm_class.advantages, GRPOTrainer.algorithm_class.step_loss})


#: What a trainer on a shared loop may redefine: its TRL signature (``__init__``); its algorithm, config class and
#: names are class attributes, and TRL attributes of its own (``XPOTrainer.alpha``) are new names, not overrides.
LOOP_OWN_METHODS = {"__init__"}


def loop_overrides(trainer: type, loop: type) -> list[str]:
    """The methods and properties of ``loop`` that ``trainer`` (a subclass of it) or a class between them redefines,
    besides :data:`LOOP_OWN_METHODS`."""
    found = []
    for cls in trainer.__mro__[:trainer.__mro__.index(loop)]:
        for name, value in vars(cls).items():
            routine = callable(value) or isinstance(value, (property, staticmethod, classmethod))
            if routine and not isinstance(value, type) and hasattr(loop, name) and name not in LOOP_OWN_METHODS:
                found.append(f"{cls.__name__}.{name}")
    return found


def test_no_trainer_overrides_its_loops_methods():
    """GRPO, RLOO and AsyncGRPO are algorithms on the policy-gradient loop, XPO and Nash-MD on Online DPO's (their
    trainers subclass it, as TRL's do), SFT, Reward and TPO on the offline loop, ORPO and CPO on it too (through the
    constructor they share), Distillation and GKD on the student-teacher loop, SDFT and SDPO on the
    self-distillation loop, DPO, KTO and BCO on the reference loop: what one step does is the loop's file plus the
    algorithm's, never a method of the loop redefined in a subclass."""
    from torchlike.trl import (
        DistillationTrainer,
        DPOTrainer,
        GRPOTrainer,
        KTOTrainer,
        RewardTrainer,
        RLOOTrainer,
        SFTTrainer,
    )
    from torchlike.trl.experimental.async_grpo import AsyncGRPOTrainer
    from torchlike.trl.experimental.bco import BCOTrainer
    from torchlike.trl.experimental.cpo import CPOTrainer
    from torchlike.trl.experimental.gkd import GKDTrainer
    from torchlike.trl.experimental.nash_md import NashMDTrainer
    from torchlike.trl.experimental.online_dpo import OnlineDPOTrainer
    from torchlike.trl.experimental.online_dpo.online_dpo_trainer import OnlinePreferenceAlgorithm
    from torchlike.trl.experimental.orpo import ORPOTrainer
    from torchlike.trl.experimental.pairwise_trainer import PairwiseAlgorithm, PairwisePreferenceTrainer
    from torchlike.trl.experimental.sdft import SDFTTrainer
    from torchlike.trl.experimental.sdpo import SDPOTrainer
    from torchlike.trl.experimental.self_distillation_trainer import SelfDistillationAlgorithm, SelfDistillationTrainer
    from torchlike.trl.experimental.tpo import TPOTrainer
    from torchlike.trl.experimental.xpo import XPOTrainer
    from torchlike.trl.trainer.distillation_trainer import StudentTeacherAlgorithm, StudentTeacherTrainer
    from torchlike.trl.trainer.offline_trainer import (
        OfflineAlgorithm,
        OfflineTrainer,
        PrecomputedReferenceTrainer,
        ReferenceAlgorithm,
    )
    from torchlike.trl.trainer.policy_gradient_trainer import PolicyGradientAlgorithm, PolicyGradientTrainer

    loops = {PolicyGradientTrainer: (PolicyGradientAlgorithm, [GRPOTrainer, RLOOTrainer, AsyncGRPOTrainer]),
             OnlineDPOTrainer: (OnlinePreferenceAlgorithm, [XPOTrainer, NashMDTrainer]),
             OfflineTrainer: (OfflineAlgorithm, [SFTTrainer, RewardTrainer, TPOTrainer, PairwisePreferenceTrainer]),
             PairwisePreferenceTrainer: (PairwiseAlgorithm, [ORPOTrainer, CPOTrainer]),
             StudentTeacherTrainer: (StudentTeacherAlgorithm, [DistillationTrainer, GKDTrainer]),
             SelfDistillationTrainer: (SelfDistillationAlgorithm, [SDFTTrainer, SDPOTrainer]),
             PrecomputedReferenceTrainer: (ReferenceAlgorithm, [DPOTrainer, KTOTrainer, BCOTrainer])}
    for loop, (algorithm, trainers) in loops.items():
        for trainer in trainers:
            assert trainer.__mro__[1] is loop, trainer
            assert loop_overrides(trainer, loop) == [], trainer
            if trainer is PairwisePreferenceTrainer:  # ORPO's and CPO's constructor: no algorithm of its own
                continue
            assert issubclass(trainer.algorithm_class, algorithm)
            assert trainer.algorithm_class is not loop.__dict__.get("algorithm_class"), trainer
    assert not issubclass(RLOOTrainer, GRPOTrainer)


def test_the_loop_override_check_fires_on_a_made_up_trainer(tmp_path, monkeypatch):
    (tmp_path / "made_up_trainer.py").write_text(
        "from torchlike.trl.trainer.grpo_trainer import GRPO\n"
        "from torchlike.trl.trainer.policy_gradient_trainer import PolicyGradientTrainer\n\n\n"
        "class MadeUpTrainer(PolicyGradientTrainer):\n    algorithm_class = GRPO\n\n"
        "    def __init__(self, model):\n        super().__init__(model)\n\n"
        "    def _rollout(self, *args):\n        return {}\n\n"
        "    def shown(self):\n        return 1\n\n"
        "    @property\n    def _samples_ahead(self):\n        return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from made_up_trainer import MadeUpTrainer

    from torchlike.trl.trainer.policy_gradient_trainer import PolicyGradientTrainer

    assert loop_overrides(MadeUpTrainer, PolicyGradientTrainer) == ["MadeUpTrainer._rollout",
                                                                    "MadeUpTrainer._samples_ahead"]


def test_the_loop_override_check_fires_on_a_made_up_offline_trainer(tmp_path, monkeypatch):
    """An offline trainer that redefines a hook of the offline loop (instead of giving its algorithm the job) is
    found, as is one that slips a class of its own between itself and the loop."""
    (tmp_path / "made_up_offline_trainer.py").write_text(
        "from torchlike.trl.trainer.offline_trainer import OfflineTrainer\n"
        "from torchlike.trl.trainer.sft_trainer import SFT\n\n\n"
        "class Between(OfflineTrainer):\n    def _neftune_length(self):\n        return len\n\n\n"
        "class MadeUpOfflineTrainer(Between):\n    algorithm_class = SFT\n\n"
        "    def _step_loss(self):\n        return None, None\n\n"
        "    def _tokenize_rows(self):\n        return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from made_up_offline_trainer import MadeUpOfflineTrainer

    from torchlike.trl.trainer.offline_trainer import OfflineTrainer

    assert loop_overrides(MadeUpOfflineTrainer, OfflineTrainer) == ["MadeUpOfflineTrainer._step_loss",
                                                                    "Between._neftune_length"]


#: What a parameter typed ``Any`` must carry on its line: why its value really is anything.
ANY_REASON = "# Any:"


def unexplained_any_parameters(path: Path) -> list[str]:
    """``"<function>(<parameter>)"`` of each parameter in ``path`` annotated ``Any`` (or ``Any | None``) without an
    ``# Any: <why>`` comment on the annotation's line (issue 42: the rest are typed with torchlike/type_aliases.py)."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            arguments = node.args
            for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
                annotation = argument.annotation
                if annotation is not None and ast.unparse(annotation) in ("Any", "Any | None") and \
                        ANY_REASON not in lines[annotation.lineno - 1]:
                    found.append(f"{node.name}({argument.arg})")
    return found


def test_every_parameter_typed_any_says_why():
    """A parameter is typed with the project's aliases (ModelLike, RowsLike, ProcessingClass, TRLArgs...), ``object``
    when any value is checked at run time, and ``Any`` only where the value really is anything, saying so."""
    found = {str(path.relative_to(ROOT)): names for path in sorted((ROOT / "torchlike").rglob("*.py"))
             if (names := unexplained_any_parameters(path))}
    assert found == {}, f"parameters typed Any with no '{ANY_REASON} <why>' comment: {found}"


def test_the_any_check_fires_on_a_made_up_module(tmp_path):
    source = tmp_path / "made_up.py"
    source.write_text("from typing import Any\n\n\ndef f(model: Any,\n      tree: Any,  # Any: a pytree\n"
                      "      rows: Any | None = None, *, size: int = 1, extra: Any = None) -> Any:\n    return model\n")
    assert unexplained_any_parameters(source) == ["f(model)", "f(rows)", "f(extra)"]


#: The modules every online trainer composes (sampling, tools, environments, reward models, prompt data): none may
#: import one algorithm's modules (a ``<name>_*`` module of ``torchlike/trl/`` or ``adapters/losses/<name>``).
ONLINE_PARTS = ("torchlike.trl.trainer.online_trainer", "torchlike.trl.online.rollouts",
                "torchlike.trl.online.rollout_worker", "torchlike.trl.online.reward_scorer",
                "torchlike.trl.online.reward_models", "torchlike.trl.online.environments",
                "torchlike.trl.online.tool_calling", "torchlike.trl.data.prompt_data",
                "torchlike.trl.data.prompt_vision")


#: The packages of ``torchlike/trl/`` whose modules are named after a trainer: the rooms and the experimental package.
TRL_PACKAGES = (["torchlike", "trl"], ["torchlike", "trl", "trainer"], ["torchlike", "trl", "data"],
                ["torchlike", "trl", "online"], ["torchlike", "trl", "experimental"])


def algorithm_imports(module: str, path: Path) -> set[str]:
    """The modules of one trainer's algorithm that ``module`` imports: ``torchlike.trl[.experimental].<name>`` or
    ``<name>_*`` (its config, data, fields, trainer...) and ``torchlike.adapters.losses.<name>``, for each trainer
    ``<name>`` of ``torchlike.trl.registry.TRAINERS`` (the online parts themselves excepted)."""
    from torchlike.trl.registry import TRAINERS

    names = {entry.name for entry in TRAINERS}
    found = set()
    for imported in imported_names(module, path):
        parts = imported.split(".")
        for index in range(2, len(parts)):
            prefix, part = parts[:index], parts[index]
            trl_module = prefix in TRL_PACKAGES and any(
                part == name or part.startswith(f"{name}_") for name in names)
            loss_module = prefix[-2:] == ["adapters", "losses"] and part in names
            candidate = ".".join(parts[:index + 1])
            if (trl_module or loss_module) and candidate not in ONLINE_PARTS:
                found.add(candidate)
                break
    return found


def test_online_parts_import_no_algorithms_modules():
    modules = module_files()
    found = {module: imports for module in ONLINE_PARTS if (imports := algorithm_imports(module, modules[module]))}
    assert found == {}, f"online parts importing one algorithm's modules (move what they share out of it): {found}"


def test_the_online_parts_check_fires_on_a_made_up_module(tmp_path):
    source = tmp_path / "online_part.py"
    source.write_text("from ..trainer.grpo_config import GRPOConfig\n"
                      "from ...adapters.losses import grpo as grpo_losses\n"
                      "from ..data import prompt_data\nfrom .. import data_utils\n"
                      "from ..experimental.nash_md import nash_md_trainer\n")
    assert algorithm_imports("torchlike.trl.online.online_part", source) == {
        "torchlike.trl.trainer.grpo_config", "torchlike.adapters.losses.grpo", "torchlike.trl.experimental.nash_md"}


#: The rooms of ``torchlike/trl/`` below the trainers: data preparation and the online parts may read the configs of
#: the trainer room (``<name>_config``, ``base_config``, the field tables), never a trainer (issue 42).
LOWER_ROOMS = ("torchlike.trl.data.", "torchlike.trl.online.")


def trainer_imports(module: str, path: Path) -> list[str]:
    """The trainer-room modules other than configs and field tables that ``module`` imports."""
    found = []
    for imported in imported_names(module, path):
        parts = imported.split(".")
        if parts[:3] == ["torchlike", "trl", "trainer"] and len(parts) > 3 and \
                not parts[3].endswith(("_config", "_fields")):
            found.append(".".join(parts[:4]))
    return sorted(set(found))


def test_data_and_online_rooms_import_configs_but_no_trainer():
    modules = module_files()
    found = {module: names for module, path in modules.items() if module.startswith(LOWER_ROOMS)
             if (names := trainer_imports(module, path))}
    assert found == {}, f"data or online modules importing a trainer (move what they share below it): {found}"


def test_the_rooms_check_fires_on_a_made_up_module(tmp_path):
    source = tmp_path / "made_up.py"
    source.write_text("from ..trainer.sft_config import SFTConfig\nfrom ..trainer.base_trainer import TRLTrainer\n"
                      "from ..trainer import callbacks\nfrom ..trainer.grpo_fields import GRPO_FIELD_SUPPORT\n")
    assert trainer_imports("torchlike.trl.data.made_up", source) == ["torchlike.trl.trainer.base_trainer",
                                                                       "torchlike.trl.trainer.callbacks"]
