"""Real office documents, generated (never downloaded): minimal but valid OOXML, ODF and RTF files
that LibreOffice opens, each holding marker words and a known number of pages."""

from __future__ import annotations

import io
import zipfile
from xml.sax.saxutils import escape

W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
REL = "http://schemas.openxmlformats.org/package/2006/relationships"
DOC_REL = "http://schemas.openxmlformats.org/officeDocument/2006/relationships"


def _zip(parts: dict[str, str], *, stored_first: str | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        if stored_first:
            archive.writestr(zipfile.ZipInfo(stored_first), parts[stored_first], compress_type=zipfile.ZIP_STORED)
        for name, text in parts.items():
            if name != stored_first:
                archive.writestr(name, text)
    return buffer.getvalue()


def _package(main_part: str, overrides: dict[str, str]) -> dict[str, str]:
    """An OOXML package's content types and root relationship to its main part."""
    types = "".join(f'<Override PartName="{name}" ContentType="application/vnd.openxmlformats-officedocument.{kind}"/>'
                    for name, kind in overrides.items())
    return {
        "[Content_Types].xml": (
            '<?xml version="1.0" encoding="UTF-8" standalone="yes"?>'
            '<Types xmlns="http://schemas.openxmlformats.org/package/2006/content-types">'
            '<Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"/>'
            f'<Default Extension="xml" ContentType="application/xml"/>{types}</Types>'),
        "_rels/.rels": (f'<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="{REL}">'
                        f'<Relationship Id="rId1" Type="{DOC_REL}/officeDocument" Target="{main_part}"/></Relationships>'),
    }


VOCABULARY = ("the", "sluice", "gate", "water", "level", "channel", "report", "vendor", "result", "minutes",
              "board", "meeting", "budget", "quarter", "review", "approved", "motion", "second", "carried",
              "action", "owner", "deadline", "risk", "plan", "update", "customer", "contract", "clause",
              "section", "appendix", "figure", "table", "total", "net", "gross", "margin", "forecast")


def docx(words: str = "Sluice marker words", *, pages: int = 1, lines: int = 1) -> bytes:
    """A Word document of `pages` pages (page breaks), each saying `words` and its number, and
    `lines` paragraphs of text on each page in all."""
    import random

    rng = random.Random(f"{words}/{pages}/{lines}")  # the same document for the same arguments
    body = []
    for page in range(1, pages + 1):
        body.append(f'<w:p><w:r><w:t>{escape(words)} page {page}</w:t></w:r></w:p>')
        # Prose-like filler: it compresses as text does (a run of one phrase would look like a zip bomb).
        body.extend(f'<w:p><w:r><w:t>{" ".join(rng.choice(VOCABULARY) for _ in range(40))}</w:t></w:r></w:p>'
                    for _ in range(1, lines))
        if page < pages:
            body.append('<w:p><w:r><w:br w:type="page"/></w:r></w:p>')
    return _zip({
        **_package("word/document.xml", {"/word/document.xml": "wordprocessingml.document.main+xml",
                                          "/docProps/app.xml": "extended-properties+xml"}),
        "word/document.xml": (f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?><w:document xmlns:w="{W}">'
                              f'<w:body>{"".join(body)}</w:body></w:document>'),
        # As Word writes it: the page count the pre-check reads to route heavy documents.
        "docProps/app.xml": ('<?xml version="1.0" encoding="UTF-8"?><Properties xmlns='
                             f'"http://schemas.openxmlformats.org/officeDocument/2006/extended-properties"><Pages>{pages}</Pages></Properties>'),
    })


def xlsx(words: str = "Sluice marker words", rows: int = 3) -> bytes:
    sheet = "".join(f'<row r="{r}"><c r="A{r}" t="inlineStr"><is><t>{escape(words)} {r}</t></is></c>'
                    f'<c r="B{r}"><v>{r * 10}</v></c></row>' for r in range(1, rows + 1))
    main = "http://schemas.openxmlformats.org/spreadsheetml/2006/main"
    return _zip({
        **_package("xl/workbook.xml", {"/xl/workbook.xml": "spreadsheetml.sheet.main+xml",
                                        "/xl/worksheets/sheet1.xml": "spreadsheetml.worksheet+xml"}),
        "xl/workbook.xml": (f'<?xml version="1.0" encoding="UTF-8"?><workbook xmlns="{main}" xmlns:r="{DOC_REL}">'
                            '<sheets><sheet name="Data" sheetId="1" r:id="rId1"/></sheets></workbook>'),
        "xl/_rels/workbook.xml.rels": (f'<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="{REL}">'
                                       f'<Relationship Id="rId1" Type="{DOC_REL}/worksheet" Target="worksheets/sheet1.xml"/>'
                                       '</Relationships>'),
        "xl/worksheets/sheet1.xml": f'<?xml version="1.0" encoding="UTF-8"?><worksheet xmlns="{main}"><sheetData>{sheet}</sheetData></worksheet>',
    })


_ODF_NS = ('xmlns:office="urn:oasis:names:tc:opendocument:xmlns:office:1.0" '
           'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" '
           'xmlns:table="urn:oasis:names:tc:opendocument:xmlns:table:1.0" '
           'xmlns:draw="urn:oasis:names:tc:opendocument:xmlns:drawing:1.0" '
           'xmlns:svg="urn:oasis:names:tc:opendocument:xmlns:svg-compatible:1.0" '
           'xmlns:presentation="urn:oasis:names:tc:opendocument:xmlns:presentation:1.0"')
_ODF_TYPES = {"odt": "text", "ods": "spreadsheet", "odp": "presentation"}


def odf(kind: str, words: str = "Sluice marker words", *, pages: int = 1) -> bytes:
    """An OpenDocument text (odt), spreadsheet (ods) or presentation (odp; one slide per page)."""
    text = escape(words)
    if kind == "odt":
        body = "".join(f"<text:p>{text} page {p}</text:p>" for p in range(1, pages + 1))
    elif kind == "ods":
        body = ('<table:table table:name="Data">' + "".join(
            f'<table:table-row><table:table-cell office:value-type="string"><text:p>{text} {r}</text:p></table:table-cell>'
            f'<table:table-cell office:value-type="float" office:value="{r}"><text:p>{r}</text:p></table:table-cell></table:table-row>'
            for r in range(1, 4)) + "</table:table>")
    else:
        body = "".join(
            f'<draw:page draw:name="slide{p}"><draw:frame svg:x="2cm" svg:y="2cm" svg:width="20cm" svg:height="3cm">'
            f'<draw:text-box><text:p>{text} slide {p}</text:p></draw:text-box></draw:frame></draw:page>'
            for p in range(1, pages + 1))
    family = _ODF_TYPES[kind]
    mime = f"application/vnd.oasis.opendocument.{family}"
    return _zip({
        "mimetype": mime,
        "META-INF/manifest.xml": (
            '<?xml version="1.0" encoding="UTF-8"?><manifest:manifest '
            'xmlns:manifest="urn:oasis:names:tc:opendocument:xmlns:manifest:1.0" manifest:version="1.2">'
            f'<manifest:file-entry manifest:full-path="/" manifest:media-type="{mime}"/>'
            '<manifest:file-entry manifest:full-path="content.xml" manifest:media-type="text/xml"/></manifest:manifest>'),
        "content.xml": (f'<?xml version="1.0" encoding="UTF-8"?><office:document-content {_ODF_NS} office:version="1.2">'
                        f'<office:body><office:{family}>{body}</office:{family}></office:body></office:document-content>'),
    }, stored_first="mimetype")


def rtf(words: str = "Sluice marker words") -> bytes:
    return ("{\\rtf1\\ansi\\deff0{\\fonttbl{\\f0 Helvetica;}}\\f0\\fs24 " + words.replace("\\", "\\\\") +
            "\\par}").encode()
