"""Submit a console form as a browser would: the values the page shows, with some changed."""

from __future__ import annotations

from html.parser import HTMLParser


class _Form(HTMLParser):
    def __init__(self, form_id: str | None):
        super().__init__()
        self.form_id, self.inside, self.values = form_id, form_id is None, []
        self._select: str | None = None
        self._textarea: str | None = None
        self._selected_any = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form" and self.form_id is not None:
            self.inside = a.get("id") == self.form_id
        if not self.inside:
            return
        name = a.get("name")
        if tag == "input" and name:
            kind = a.get("type", "text")
            if kind in ("checkbox", "radio"):
                if "checked" in a:
                    self.values.append((name, a.get("value", "on")))
            elif kind not in ("submit", "button", "file", "image"):
                self.values.append((name, a.get("value", "")))
        elif tag == "select" and name:
            self._select = name
        elif tag == "option" and self._select and "selected" in a:
            self.values.append((self._select, a.get("value", "")))
        elif tag == "textarea" and name:
            self._textarea = name
            self.values.append((name, ""))

    def handle_data(self, data):
        if self._textarea:
            key, value = self.values[-1]
            self.values[-1] = (key, value + data)

    def handle_endtag(self, tag):
        if tag == "select":
            self._select = None
        elif tag == "textarea":
            self._textarea = None
        elif tag == "form" and self.form_id is not None:
            self.inside = False


def form_values(html: str, form_id: str | None = None, **changes) -> dict[str, list[str] | str]:
    parser = _Form(form_id)
    parser.feed(html)
    data: dict[str, list[str]] = {}
    for name, value in parser.values:
        data.setdefault(name, []).append(value)
    for name, value in changes.items():
        data[name] = value if isinstance(value, list) else [value]
    return {k: (v[0] if len(v) == 1 else v) for k, v in data.items()}
