from __future__ import annotations

import json

from django import forms

from tasks.api.bodies import MAX_LABEL, upload_label
from tasks.filetypes import KINDS, TARGET_FORMATS

TARGETS = sorted({t for targets in TARGET_FORMATS.values() for t in targets})


class SubmitForm(forms.Form):
    file = forms.FileField(help_text="Audio to transcribe, or a document to convert.")
    kind = forms.ChoiceField(choices=[(k, k.capitalize()) for k in KINDS], initial=KINDS[0],
                             widget=forms.Select(attrs={"data-formats": json.dumps({k: list(TARGET_FORMATS[k]) for k in KINDS})}))
    # The default is valid for the default kind; the page offers only the formats of the kind chosen.
    target_format = forms.ChoiceField(choices=[(t, t) for t in TARGETS], initial=TARGET_FORMATS[KINDS[0]][0])
    priority = forms.ChoiceField(choices=[("interactive", "Interactive (fast lane)"), ("batch", "Batch")], initial="batch")

    def clean_file(self):
        upload = self.cleaned_data["file"]
        if len(upload_label(upload)) > MAX_LABEL:
            raise forms.ValidationError(f"The file name is longer than {MAX_LABEL} characters; rename the file and upload it again.")
        return upload

    def clean(self):
        data = super().clean()
        kind, target = data.get("kind"), data.get("target_format")
        if kind and target and target not in TARGET_FORMATS[kind]:
            self.add_error("target_format", f"For {kind}, choose one of: {', '.join(TARGET_FORMATS[kind])}.")
        return data
