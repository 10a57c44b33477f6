"""The chat template the router renders conversations with: `model.chat_template` (vLLM's `--chat-template`):
`auto` (the model's own, except the embedded SmolLM2's, below), a template shipped in deployments/api/templates/ by
its name, a Jinja file, or the template's text.

Shipped: `smollm2_tools`, the embedded model's ChatML template with tools (its own renders no tools): the tools
in the system message and the calls as `<tool_call>` JSON (the `hermes` parser's format), tool results as
`<tool_response>` user turns. Without tools it renders exactly what the model's own template renders (test).
"""

from __future__ import annotations

from pathlib import Path

TEMPLATES_DIR = Path(__file__).parent / "templates"
AUTO = {"smollm2": "smollm2_tools"}  # target alias -> the shipped template `auto` means for it


def chat_template_for(value: str, target: str) -> str | None:
    """The template text `model.chat_template` asks for with this target; None: the model's own."""
    if value == "auto":
        return chat_template_text(AUTO[target]) if target in AUTO else None
    return chat_template_text(value)


def shipped_templates() -> list[str]:
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def chat_template_text(value: str) -> str:
    """The template `value` names; ValueError saying what it accepts when it names none."""
    if "{{" in value or "{%" in value:
        return value
    shipped = TEMPLATES_DIR / f"{value}.jinja"
    if shipped.is_file():
        return shipped.read_text()
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(f"chat_template {value!r} is neither a shipped template ({', '.join(shipped_templates())}), "
                     "a file, nor a Jinja template's text")
