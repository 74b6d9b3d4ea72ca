"""The disclosure report: Markdown, HTML, PDF, JSON (validated against ``report.schema.json``) and CSV.

- ``evidence.py``   every query the report needs, run once, and the splits its sections use
- ``sentences.py``  what it says: the summary, each tenant's notice, measures, containment
- ``build.py``      ``build``: the report as one dict, after GDPR Art. 33(3) (a)-(d), then the evidence
- ``render.py``     ``markdown``, ``html``, ``write`` (and the PDF, printed by Chromium)

Every number comes from the named queries over the store; provenance records the store's chain head
and the SHA-256 of every query file. No leaked content and no canary is ever included: the store
holds none; ``--include-excerpts`` adds the keyed n-gram evidence only.
"""
from forensics.report.build import Event, ReportError, build, parse_event  # noqa: F401
from forensics.report.render import FORMATS, RenderError, html, markdown, write  # noqa: F401
