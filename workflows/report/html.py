"""The report page: one self-contained HTML file (figures and images inline as data: URIs, no script,
no external link), readable offline in any browser."""
from __future__ import annotations

import base64
import html
import math

CSS = """
body{font-family:system-ui,-apple-system,"DejaVu Sans",sans-serif;margin:0 auto;max-width:1180px;padding:0 24px 48px;
color:#1d1d1f;line-height:1.45}
h1{margin:24px 0 4px;font-size:26px}h2{margin-top:36px;border-bottom:2px solid #ddd;padding-bottom:4px;font-size:20px}
h3{font-size:16px;margin:18px 0 6px}
nav{position:sticky;top:0;background:#fafafa;border-bottom:1px solid #ddd;padding:6px 0;font-size:13px;z-index:1}
nav a{margin-right:12px;color:#0b57d0;text-decoration:none}
table{border-collapse:collapse;margin:8px 0 12px;font-size:13px}
th,td{border:1px solid #d0d0d0;padding:3px 7px;text-align:right;vertical-align:top}
td{white-space:nowrap}td.l{white-space:normal}
th{background:#f0f0f0}td.l,th.l{text-align:left}
tr:nth-child(even) td{background:#fafafa}
figure{margin:10px 0 18px}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:13px;color:#444;max-width:1000px}
.muted{color:#666;font-size:13px}.note{background:#fff8e1;border-left:4px solid #f0b400;padding:6px 10px;font-size:13px}
.sbs img{width:128px;height:128px;image-rendering:pixelated;display:block;margin:auto}
.sbs td{text-align:center;font-size:12px}.sbs td.l{max-width:260px;text-align:left}
code{background:#f3f3f3;padding:0 3px;border-radius:3px;font-size:12.5px}
"""


def esc(x) -> str:
    return html.escape(str(x))


def fmt(v, nd: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def pct(v, nd: int = 1) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.{nd}f}%"


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def img(png: bytes, alt: str = "", cls: str = "") -> str:
    return f'<img src="{data_uri(png)}" alt="{esc(alt)}"{f" class={cls!r}" if cls else ""}>'


def figure(png: bytes, caption: str, alt: str) -> str:
    return f"<figure>{img(png, alt)}<figcaption>{caption}</figcaption></figure>"


def table(headers: list[str], rows: list[list], left: int = 1, cls: str = "") -> str:
    """Cells are HTML already (use esc/fmt); the first `left` columns are left-aligned."""
    th = "".join(f'<th class="{"l" if i < left else ""}">{h}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{"l" if i < left else ""}">{c}</td>' for i, c in enumerate(r)) + "</tr>"
                   for r in rows)
    return f'<table{f" class={cls!r}" if cls else ""}><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def page(title: str, subtitle: str, sections: list[tuple[str, str, str]]) -> str:
    """sections: (anchor, heading, HTML body)."""
    nav = "".join(f'<a href="#{a}">{esc(h)}</a>' for a, h, _ in sections)
    body = "".join(f'<section id="{a}"><h2>{esc(h)}</h2>{b}</section>' for a, h, b in sections)
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>'
            f'<body><h1>{esc(title)}</h1><p class="muted">{subtitle}</p><nav>{nav}</nav>{body}</body></html>')
