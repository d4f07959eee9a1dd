"""Step metrics that only some micro-batches record (TRL logs, e.g., ``rewards/rejected`` only for batches holding a
rejected example): a loss returns each such metric with a ``present/<name>`` indicator, both are averaged over the
same micro-batches, and :func:`finish_metrics` divides them back into TRL's mean over the batches that recorded it.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Prefix of the indicator a step loss returns beside a metric that only some micro-batches record.
PRESENCE_PREFIX = "present/"


def finish_metrics(logs: Mapping[str, float]) -> dict[str, float]:
    """Logged metrics with TRL's values: each metric that has a ``present/<name>`` indicator (both averaged over the
    same micro-batches) divided by it, so it is the mean over the micro-batches that recorded it; dropped when none
    did, as TRL logs nothing then. The indicators are removed. Works on prefixed keys (``eval_present/...``).

    Args:
        logs: a log entry, e.g. ``{"loss": ..., "rewards/chosen": ..., "present/rewards/chosen": ...}``.

    Returns:
        The entry without indicators.
    """
    finished = dict(logs)
    for key, presence in logs.items():
        prefix, marker, name = key.partition(PRESENCE_PREFIX)
        if not marker:
            continue
        del finished[key]
        if presence > 0:
            finished[prefix + name] = logs[prefix + name] / presence
        else:
            finished.pop(prefix + name, None)
    return finished
