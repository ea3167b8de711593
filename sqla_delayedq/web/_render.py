"""What the dashboard's templates show: times, durations, payloads and bar charts."""

from __future__ import annotations

import base64
import contextlib
import json
from datetime import UTC, datetime
from typing import Any

from ..controls import QueueControls

__all__ = [
    "bars",
    "compact",
    "control_labels",
    "human_seconds",
    "number",
    "payload_views",
    "short",
    "when",
]


def human_seconds(seconds: float) -> str:
    seconds = abs(seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{int(seconds // size)}{unit}")
            seconds %= size
        if len(parts) == 2:
            break
    return " ".join(parts)


def number(value: float) -> str:
    """A number of seconds as typed in a form: ``300``, ``0.5``."""
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def control_labels(c: QueueControls | None) -> list[tuple[str, str]]:
    """(kind, label) of each control a queue has: paused, its in-flight and its rate limit."""
    if c is None:
        return []
    labels = [("paused", "paused")] if c.paused else []
    if c.max_in_flight is not None:
        labels.append(("in-flight", f"≤ {c.max_in_flight} in flight"))
    if c.rate_limit is not None and c.rate_period is not None:
        period = number(c.rate_period.total_seconds())
        labels.append(("rate", f"≤ {c.rate_limit} per {period} s"))
    return labels


def when(value: datetime | None, now: datetime | None = None) -> str:
    if value is None:
        return "-"
    text = value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if now is None:
        return text
    delta = (value - now).total_seconds()
    rel = f"in {human_seconds(delta)}" if delta > 0 else f"{human_seconds(delta)} ago"
    return f"{text} ({rel})"


def payload_views(payload: Any) -> list[tuple[str, str]]:
    """(label, text) views of a payload: pretty JSON, or bytes as hex and base64."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        raw = bytes(payload)
        views = [("base64", base64.b64encode(raw).decode("ascii")), ("hex", raw.hex(" "))]
        with contextlib.suppress(UnicodeDecodeError):
            views.insert(0, ("UTF-8 text", raw.decode("utf-8")))
        return views
    return [("JSON", json.dumps(payload, indent=2, ensure_ascii=False, sort_keys=True))]


def compact(payload: Any, width: int = 80) -> str:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        text = f"{len(bytes(payload))} bytes: {bytes(payload)[:24].hex(' ')}"
    else:
        text = json.dumps(payload, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= width else text[: width - 1] + "…"


def short(text: str | None, width: int = 60) -> str:
    if not text:
        return ""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 1] + "…"


def bars(
    processed: tuple[int, ...], failed: tuple[int, ...], width: int = 240, height: int = 40
) -> dict[str, Any]:
    """Rectangles of a per-minute bar chart (processed above, failed in red), for inline SVG."""
    n = max(1, len(processed))
    top = max([p + f for p, f in zip(processed, failed, strict=True)] or [0]) or 1
    step = width / n
    rects = []
    for i, (p, f) in enumerate(zip(processed, failed, strict=True)):
        hp = height * p / top
        hf = height * f / top
        x = round(i * step, 2)
        w = round(max(step - 1, 1), 2)
        if p:
            rects.append({"x": x, "y": round(height - hp, 2), "w": w, "h": round(hp, 2), "c": "ok"})
        if f:
            y = round(height - hp - hf, 2)
            rects.append({"x": x, "y": y, "w": w, "h": round(hf, 2), "c": "bad"})
    return {"width": width, "height": height, "rects": rects, "top": top}
