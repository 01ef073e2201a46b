"""svg_plot: a line chart drawn by hand as a standalone SVG (no plotting
library on the machines), shared by the scripts that draw the docs' curves
(scripts/host-curve, scripts/llama-results)."""
import math


def svg_plot(path, title, xlabel, ylabel, xs, series):
    """A line chart (x on a log2 axis, y on a log10 axis) as a standalone SVG; series are
    (name, values, colour index, dashed)."""
    W, H, L, R, T, B = 760, 460, 70, 230, 40, 50
    ys = [y for _, pts, _, _ in series for y in pts if y is not None and y > 0]
    lo, hi = math.log10(min(ys)), math.log10(max(ys))
    span = (hi - lo) or 1.0
    lo, hi = lo - 0.05 * span, hi + 0.05 * span
    xl, xh = math.log2(xs[0]), math.log2(xs[-1])
    px = lambda x: L + (math.log2(x) - xl) / ((xh - xl) or 1) * (W - L - R)
    py = lambda y: T + (hi - math.log10(y)) / (hi - lo) * (H - T - B)
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#000000", "#7f7f7f"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
           f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">{xlabel}</text>',
           f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" '
           f'transform="rotate(-90 16 {(T + H - B) / 2})">{ylabel}</text>']
    for x in xs:
        out.append(f'<line x1="{px(x):.1f}" y1="{H - B}" x2="{px(x):.1f}" y2="{H - B + 5}" stroke="black"/>')
        label = f"{x // 1024}K" if x % 1024 == 0 else str(x)
        out.append(f'<text x="{px(x):.1f}" y="{H - B + 18}" text-anchor="middle">{label}</text>')
    for v in [math.log10(m * 10 ** e) for e in range(-3, 6) for m in (1, 2, 5)]:
        if not lo <= v <= hi:
            continue
        y = T + (hi - v) / (hi - lo) * (H - T - B)
        out.append(f'<line x1="{L - 5}" y1="{y:.1f}" x2="{W - R}" y2="{y:.1f}" stroke="#dddddd"/>')
        out.append(f'<text x="{L - 8}" y="{y + 4:.1f}" text-anchor="end">{10 ** v:g}</text>')
    for i, (name, pts, color, dashed) in enumerate(series):
        c = colors[color % len(colors)]
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        coords = [(px(x), py(y)) for x, y in zip(xs, pts) if y is not None and y > 0]
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2"{dash} points="' +
                   " ".join(f"{a:.1f},{b:.1f}" for a, b in coords) + '"/>')
        for a, b in coords:
            out.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{c}"/>')
        out.append(f'<line x1="{W - R + 15}" y1="{T + 20 * i + 10}" x2="{W - R + 40}" y2="{T + 20 * i + 10}" '
                   f'stroke="{c}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{W - R + 46}" y="{T + 20 * i + 14}">{name}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
