"""torchlike.trl.experimental.iw_opd: TRL 1.16's ``trl.experimental.iw_opd`` (``IWOPDConfig``, ``IWOPDTrainer``),
loaded on first use."""

from torchlike.trl.registry import package_exports

__all__, __getattr__, __dir__ = package_exports(__name__)
