"""Opens stallprof's outputs in the viewers people use, in headless Chromium
(Debian's /usr/bin/chromium, driven by playwright: no browser download), and
writes what each page shows as JSON for tests/viewers.rs to judge.

It reads page state, never pixels: the text speedscope puts in its hover
tooltip and its Sandwich table (both DOM), inferno's "Matched: X%" (an SVG
text element), the frame names pprof's flame graph page holds, every
request the page made (playwright's request log) and every console error.

    python viewers.py speedscope URL OUT.json FRACTIONS.json
    python viewers.py svg URL OUT.json TERMS.json
    python viewers.py pprof URL OUT.json
    python viewers.py served URL OUT.json

FRACTIONS: where on the Time Order view's time axis to hover (0..1 of the
profile's span: each stall's middle). TERMS: regular expressions for the
flame graph's Search button.
"""

import json
import re
import sys

from playwright.sync_api import sync_playwright

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
WIDTH, HEIGHT = 1600, 900
# speedscope's own duration format at the head of its tooltip: "422.13ms (7.9%)".
DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)(ns|µs|ms|s|min)\s+\(")


class Visit:
    def __init__(self, p):
        self.browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        self.page = self.browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        self.requests = []
        self.errors = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on(
            "console",
            lambda m: self.errors.append(m.text) if m.type == "error" else None,
        )
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def result(self, **more):
        out = {"requests": self.requests, "console_errors": self.errors}
        out.update(more)
        return out


def tooltip_text(page):
    """The text of speedscope's hover tooltip: the innermost element whose
    text starts with a duration and its share ("422.13ms (7.9%) stall …")."""
    return page.evaluate(
        """(pat) => {
            const re = new RegExp(pat);
            const hits = Array.from(document.querySelectorAll('div'))
                .filter(d => d.innerText && re.test(d.innerText));
            hits.sort((a, b) => a.innerText.length - b.innerText.length);
            return hits.length ? hits[0].innerText : null;
        }""",
        DURATION.pattern.replace("(?:", "(?:"),
    )


def sandwich_rows(page, n=40):
    """The Sandwich table's first rows as [total, self, symbol] (its rows
    are DOM: a virtualised list, the top ones rendered)."""
    return page.evaluate(
        """(n) => Array.from(document.querySelectorAll('tr')).slice(0, n + 1)
              .map(tr => Array.from(tr.querySelectorAll('td')).map(td => td.innerText.trim()))
              .filter(cells => cells.length >= 3)""",
        n,
    )


def speedscope(url, fractions):
    with sync_playwright() as p:
        v = Visit(p)
        page = v.page
        page.goto(url)
        page.wait_for_function("document.title.includes('stallprof')", timeout=30000)
        title = page.title()
        page.wait_for_timeout(300)
        # Time Order: the flame chart is the tallest canvas below the
        # minimap; its first row (the stalls, speedscope's roots) is found
        # by moving down from its top until the tooltip names a frame.
        canvases = page.evaluate(
            """() => Array.from(document.querySelectorAll('canvas')).map(c => {
                 const r = c.getBoundingClientRect();
                 return [r.x, r.y, r.width, r.height]; })"""
        )
        chart = max(
            (c for c in canvases if c[1] > 0), key=lambda c: c[3], default=None
        )
        hovers, row_y = [], None
        if chart is not None and fractions:
            x0, y0, w, h = chart
            for dy in range(2, 80, 3):
                page.mouse.move(x0 + fractions[0] * w, y0 + dy)
                page.wait_for_timeout(40)
                if tooltip_text(page):
                    row_y = y0 + dy + 4
                    break
            for f in fractions:
                if row_y is None:
                    hovers.append(None)
                    continue
                page.mouse.move(x0 + f * w, row_y)
                page.wait_for_timeout(40)
                hovers.append(tooltip_text(page))
            page.mouse.move(1, 1)
        # Sandwich: its table sorted by self time (speedscope's default),
        # then by total time (a click on the Total header).
        page.get_by_text("Sandwich", exact=False).first.click()
        page.wait_for_selector("tr td", timeout=10000)
        by_self = sandwich_rows(page)
        page.locator("th", has_text="Total").first.click()
        page.wait_for_timeout(200)
        by_total = sandwich_rows(page)
        return v.result(
            title=title,
            hovers=hovers,
            sandwich_by_self=by_self,
            sandwich_by_total=by_total,
        )


def svg(url, terms):
    with sync_playwright() as p:
        v = Visit(p)
        page = v.page
        pending = {"term": None}
        page.on("dialog", lambda d: d.accept(pending["term"] or ""))
        page.goto(url)
        page.wait_for_selector("#search")
        matched = {}
        for t in terms:
            pending["term"] = t
            page.click("#search")
            page.wait_for_timeout(100)
            matched[t] = page.text_content("#matched")
            # The button now reads "Reset Search": clear it for the next term.
            page.click("#search")
            page.wait_for_timeout(50)
        return v.result(matched=matched, title=page.title())


def pprof(url):
    with sync_playwright() as p:
        v = Visit(p)
        page = v.page
        page.goto(url)
        page.wait_for_load_state("networkidle")
        page.wait_for_timeout(500)
        # The flame graph's nodes: pprof 1.19's page keeps its tree in the
        # global `data` ({n: name, c: children}) it draws from.
        names = page.evaluate(
            """() => {
                if (typeof data === 'undefined') return null;
                const out = [];
                const walk = (n) => { out.push(n.n); (n.c || []).forEach(walk); };
                walk(data);
                return out;
            }"""
        )
        return v.result(names=names, title=page.title())


def served(url):
    """`report --serve`'s page: its links, then speedscope from its link."""
    with sync_playwright() as p:
        v = Visit(p)
        page = v.page
        page.goto(url)
        index_title = page.title()
        links = page.evaluate(
            "() => Array.from(document.querySelectorAll('a')).map(a => [a.id, a.getAttribute('href')])"
        )
        rows = page.evaluate(
            "() => Array.from(document.querySelectorAll('tr.stall')).map(tr => tr.innerText)"
        )
        svg_status = None
        r = page.request.get(url.rstrip("/") + "/stalls.svg")
        svg_status = [r.status, r.headers.get("content-type")]
        speedscope_title = None
        if page.locator("a#speedscope").count():
            page.click("a#speedscope")
            page.wait_for_function(
                "document.title.includes('stallprof')", timeout=30000
            )
            page.wait_for_timeout(300)
            speedscope_title = page.title()
        return v.result(
            index_title=index_title,
            links=links,
            rows=rows,
            svg=svg_status,
            speedscope_title=speedscope_title,
        )


def main():
    what, url, out = sys.argv[1], sys.argv[2], sys.argv[3]
    if what == "speedscope":
        res = speedscope(url, json.load(open(sys.argv[4])))
    elif what == "svg":
        res = svg(url, json.load(open(sys.argv[4])))
    elif what == "pprof":
        res = pprof(url)
    elif what == "served":
        res = served(url)
    else:
        sys.exit(f"unknown view {what!r}")
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
