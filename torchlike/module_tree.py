"""``print(model)``: a Flax NNX module tree rendered as torch renders ``nn.Module``s."""

from __future__ import annotations


def module_tree_lines(module, name: str | None = None) -> list[str]:
    """``torch``-style module tree lines; identical consecutive list entries collapse to ``(0-N): K x Layer``."""
    from flax import nnx

    children, shapes = [], []
    for attribute, value in vars(module).items():
        if isinstance(value, nnx.Module):
            children.append((attribute, value))
        elif isinstance(value, nnx.Param):
            shapes.append(f"{attribute}={tuple(value.get_value().shape)}")
    prefix = f"({name}): " if name is not None else ""
    head = f"{prefix}{type(module).__name__}({', '.join(shapes)}"
    if not children:
        return [head + ")"]
    rendered = [(attribute, module_tree_lines(child, attribute)) for attribute, child in children]
    lines, index = [head + ("" if not shapes else ",")], 0
    while index < len(rendered):
        attribute, child_lines = rendered[index]
        run = index
        while (run + 1 < len(rendered) and str(rendered[run + 1][0]).isdigit()
               and rendered[run + 1][1][1:] == child_lines[1:]):
            run += 1
        if run > index:
            body = child_lines[0].split(": ", 1)[1]
            child_lines = [f"({attribute}-{rendered[run][0]}): {run - index + 1} x {body}", *child_lines[1:]]
        lines.extend("  " + line for line in child_lines)
        index = run + 1
    lines.append(")")
    return lines
