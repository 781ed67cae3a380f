"""Links from a page into a study's data folder (docs/invariance/,
docs/batch_size_schedules/, docs/batch_norm/) browse on the repository, not
on the site, which holds pages only: on the site they become the path,
as code. Images in those folders are untouched (Sphinx copies them)."""

import re

DATA_FOLDERS = ("invariance", "batch_size_schedules", "batch_norm")
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(((?:%s)/[^)]*)\)" % "|".join(DATA_FOLDERS))


def _rewrite(match):
    text, path = match.group(1), match.group(2)
    if path.endswith(".png"):
        return match.group(0)
    shown = f"`docs/{path}`"
    return shown if path.rstrip("/") in text else f"{text} ({shown})"


def _source_read(app, docname, source):
    if "/" not in docname:  # the pages in docs/ itself
        source[0] = _LINK.sub(_rewrite, source[0])


def setup(app):
    app.connect("source-read", _source_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
