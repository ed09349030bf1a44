"""A task's result as a download, for the API and the portal alike."""

from __future__ import annotations

import os

from django.http import FileResponse, HttpResponse, HttpResponseRedirect

from tasks.api.problems import problem
from tasks.errors import NotReady
from tasks.models import Task
from tasks.states import State
from tasks.storage import result_exists, result_file, result_link


def result_filename(task: Task) -> str:
    """The name a result is saved under: the uploaded file's name with the result's extension
    (meeting.wav → meeting.srt); the task id when the upload had no usable name."""
    label = os.path.basename((task.file.label if task.file_id else "") or "").strip()
    stem = os.path.splitext(label)[0]
    stem = "".join(c for c in stem if c.isprintable() and c not in '"\\/:*?<>|').strip(" .")[:120]
    return f"{stem or task.pk}.{task.target_format}"


def result_response(task: Task) -> HttpResponse:
    if task.state != State.SUCCEEDED or not task.result_path:
        raise NotReady(f"The task is {task.state}; its result can be downloaded once it is SUCCEEDED.", state=task.state)
    if not result_exists(task.result_path):
        return problem(410, "result_expired", "The result is past its retention and was removed.")
    link = result_link(task.result_path, filename=result_filename(task),
                       content_type=task.result_content_type or "application/octet-stream")
    if link is not None:
        # In a bucket: a pre-signed link, valid as long as Sluice's own signed links.
        response = HttpResponseRedirect(link)
        response["X-Content-SHA256"] = task.result_sha256
        response["Cache-Control"] = "private, no-store"
        return response
    path = result_file(task.result_path)
    response = FileResponse(open(path, "rb"), content_type=task.result_content_type or "application/octet-stream",
                            as_attachment=True, filename=result_filename(task))
    response["X-Content-SHA256"] = task.result_sha256
    return response
