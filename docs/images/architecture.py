"""Draws docs/images/architecture.svg, the README's picture of archway's parts and the path of a
pod through them. The SVG is written by this script and kept beside it; change the picture here
and run it again:

    python3 docs/images/architecture.py

Standard library only. The picture has an opaque background of its own, so it reads the same on
GitHub's light and dark themes.
"""
import os
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 980, 640
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
INK = "#1f2328"
MUTED = "#57606a"
PATH = "#0969da"       # the path of a pod
LEARN = "#8250df"      # what the closed loop reads and learns

# fill, stroke of each kind of box
ARCHWAY = ("#ddf4ff", "#0969da")
GATE = ("#fbefff", "#8250df")
EXTENDER = ("#dafbe1", "#1a7f37")
OBJECTS = ("#fff8c5", "#9a6700")
OUTSIDE = ("#f6f8fa", "#57606a")

out: list[str] = []


def text(x: float, y: float, words: str, size: int = 13, weight: str = "normal",
         colour: str = INK, anchor: str = "middle") -> None:
    out.append(f'<text x="{x}" y="{y}" font-family="{FONT}" font-size="{size}" '
               f'font-weight="{weight}" fill="{colour}" text-anchor="{anchor}">'
               f'{escape(words)}</text>')


def box(x: int, y: int, w: int, h: int, title: str, lines: list[str],
        style: tuple[str, str], dashed: bool = False) -> None:
    fill, stroke = style
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="8" fill="{fill}" '
               f'stroke="{stroke}" stroke-width="2"{dash}/>')
    text(x + w / 2, y + 22, title, size=14, weight="bold")
    for i, line in enumerate(lines):
        text(x + w / 2, y + 42 + 17 * i, line, size=12, colour=MUTED if not line.startswith("•")
             else INK)


def arrow(points: list[tuple[float, float]], colour: str, dashed: bool = False,
          both: bool = False) -> None:
    d = "M " + " L ".join(f"{x} {y}" for x, y in points)
    dash = ' stroke-dasharray="6 4"' if dashed else ""
    marker = "learn" if colour == LEARN else "path"
    start = f' marker-start="url(#{marker}-back)"' if both else ""
    out.append(f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="2.2"{dash}'
               f' marker-end="url(#{marker})"{start}/>')


def step(x: float, y: float, n: str) -> None:
    """A numbered disc on the path of a pod."""
    out.append(f'<circle cx="{x}" cy="{y}" r="11" fill="{PATH}"/>')
    text(x, y + 4.5, n, size=12, weight="bold", colour="#ffffff")


def label(x: float, y: float, words: str, colour: str = INK, anchor: str = "middle") -> None:
    text(x, y, words, size=12, colour=colour, anchor=anchor)


def draw() -> str:
    out.clear()
    out.append(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
               f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-labelledby="title desc">')
    out.append('<title id="title">archway: its parts and the path of a pod</title>')
    out.append('<desc id="desc">A pod is created; the apiserver sends it to archway\'s admission '
               'webhook, which reads its images\' architectures from image records or the '
               'registries and patches the pod with a kubernetes.io/arch constraint, or gates '
               'it for the gate controller to place. The scheduler, with archway\'s extender and '
               'Prometheus, binds it to a node of a fitting architecture. The gate controller\'s '
               'closed loop learns from exec format errors, repairs pods archway never saw and '
               'watches re-pushed tags.</desc>')
    out.append("<defs>")
    for name, colour in (("path", PATH), ("learn", LEARN)):
        out.append(f'<marker id="{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                   f'markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
                   f'fill="{colour}"/></marker>')
        out.append(f'<marker id="{name}-back" viewBox="0 0 10 10" refX="9" refY="5" '
                   f'markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
                   f'<path d="M 0 0 L 10 5 L 0 10 z" fill="{colour}"/></marker>')
    out.append("</defs>")
    out.append(f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" rx="12" fill="#ffffff" '
               f'stroke="#d0d7de" stroke-width="1.5"/>')
    text(WIDTH / 2, 30, "archway: the parts, and the path of a pod (1 to 6)", size=17,
         weight="bold")

    # Row 1: who creates the pod, the apiserver, the webhook, the registries.
    box(20, 60, 190, 80, "Pod creator", ["kubectl, a Deployment,", "a Job, ..."], OUTSIDE)
    box(270, 60, 200, 80, "kube-apiserver", ["calls the webhook", "on every pod CREATE"], OUTSIDE)
    box(530, 50, 220, 100, "Admission webhook", ["POST /mutate", "• reads every image's platforms",
                                                "• patches kubernetes.io/arch"], ARCHWAY)
    box(800, 50, 160, 100, "Registries", ["OCI, Docker, SIF", "with the pod's", "pull secrets"],
        OUTSIDE)

    # Row 2: archway's objects in the API; the gate controller and its closed loop.
    box(20, 195, 210, 160, "archway's CRDs", ["• image records: the",
                                              "  architectures of each image",
                                              "• PlacementPolicy,",
                                              "  ClusterPlacementPolicy",
                                              "kept in the apiserver,",
                                              "shared by every replica"], OBJECTS)
    box(530, 205, 260, 150, "Gate controller (one leader)", ["• places and releases gated pods",
                                                            "closed loop:",
                                                            "• learns from exec format errors",
                                                            "• repairs pods archway never saw",
                                                            "• watches re-pushed tags"], GATE)

    # Row 3: the nodes, the scheduler, the extender, Prometheus.
    box(20, 420, 190, 110, "Nodes", ["amd64, arm64,", "ppc64le, s390x", "(only those the",
                                     "images run on)"], OUTSIDE)
    box(270, 430, 200, 90, "kube-scheduler", ["or archway's second", "scheduler"], OUTSIDE)
    box(530, 420, 220, 110, "Scheduler extender", ["/scheduler/filter: right arch",
                                                  "/scheduler/prioritize:",
                                                  "least busy network links"], EXTENDER)
    box(810, 430, 150, 90, "Prometheus", ["link traffic", "per node, sampled"], OUTSIDE)

    # The path of a pod.
    arrow([(210, 100), (268, 100)], PATH)
    step(239, 86, "1")
    arrow([(470, 84), (528, 84)], PATH)
    step(499, 70, "2")
    arrow([(528, 124), (472, 124)], PATH)
    step(499, 141, "4")
    arrow([(750, 100), (798, 100)], PATH)
    step(774, 86, "3")
    arrow([(600, 203), (600, 180), (440, 180), (440, 142)], PATH, both=True)
    label(520, 197, "gated pods, placed", PATH)
    out.append(f'<line x1="200" y1="195" x2="288" y2="141" stroke="{MUTED}" stroke-width="2"/>')
    arrow([(370, 140), (370, 428)], PATH)
    label(362, 177, "watch", MUTED, anchor="end")
    label(378, 300, "a pod to bind", MUTED, anchor="start")
    arrow([(470, 465), (528, 465)], PATH, both=True)
    step(499, 451, "5")
    arrow([(808, 475), (752, 475)], PATH, dashed=True)
    arrow([(270, 485), (212, 485)], PATH)
    step(241, 471, "6")
    label(241, 505, "bind", PATH)

    # The gate controller and the closed loop.
    arrow([(790, 260), (860, 260), (860, 152)], LEARN, dashed=True)
    label(866, 200, "resolve gated", LEARN, anchor="start")
    label(866, 215, "pods' images,", LEARN, anchor="start")
    label(866, 230, "re-read tags", LEARN, anchor="start")
    arrow([(115, 420), (115, 385), (660, 385), (660, 357)], LEARN, dashed=True)
    label(385, 378, "exec format errors, unseen pods", LEARN, anchor="start")

    # The legend.
    out.append(f'<line x1="40" y1="580" x2="80" y2="580" stroke="{PATH}" stroke-width="2.2"/>')
    label(90, 584, "the path of a pod: 1 created, 2 sent to the webhook, 3 its images read,",
          anchor="start")
    label(90, 601, "4 admitted with an architecture constraint (or gated until the gate controller "
          "places it),", anchor="start")
    label(90, 618, "5 the scheduler asks the extender, 6 bound to a node its images run on.",
          anchor="start")
    out.append(f'<line x1="700" y1="601" x2="740" y2="601" stroke="{LEARN}" stroke-width="2.2" '
               f'stroke-dasharray="6 4"/>')
    label(750, 605, "what the loop reads", anchor="start")
    out.append("</svg>")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    target = os.path.join(os.path.dirname(os.path.abspath(__file__)), "architecture.svg")
    with open(target, "w", encoding="utf-8") as f:
        f.write(draw())
    print(target)
