"""Write the quickstart's files into a fresh project (``django-admin startproject proj``,
then ``manage.py startapp chat``).

Usage: ``python quickstart_project.py QUICKSTART_MD PROJECT_DIR BROKER_URL QUEUE``

Every file comes from a code block of ``docs/tutorial/quickstart.md``, found by
the path the text names just before it (``proj/celery.py``, ``chat/workflows.py``...),
so the end-to-end test installs exactly what the tutorial tells a user to write.
What a reader fills in by hand is filled in the same way here, and only that:

- the settings block goes at the end of ``proj/settings.py``, and its
  ``INSTALLED_APPS = [`` (whose "# ... django.contrib apps ..." stands for the
  project's own) keeps the apps ``startproject`` listed;
- the URL block's ``# ...`` stands for ``startproject``'s admin route;
- ``chat/urls.py`` is included from ``proj/urls.py``, as the tutorial says;
- the broker URL is the test's (a Redis database of its own, not the reader's 0), and
  the Celery queue one of the run's own.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def blocks(markdown: str) -> list[tuple[str, str]]:
    """``(text before the block, python code)`` for each python block."""
    found = []
    for match in re.finditer(r"```python\n(.*?)```", markdown, re.S):
        before = markdown[: match.start()].rstrip().splitlines()[-3:]
        found.append(("\n".join(before), match.group(1)))
    return found


def block_after(markdown: str, *names: str) -> str:
    """The first python block whose preceding lines name all of ``names``."""
    for before, code in blocks(markdown):
        if all(name in before for name in names):
            return code
    raise SystemExit(f"quickstart.md has no python block after a line naming {names}")


def main(quickstart: Path, project: Path, broker: str, queue: str) -> None:
    markdown = quickstart.read_text()
    settings_block = block_after(markdown, "proj/settings.py")
    settings_block = settings_block.replace("INSTALLED_APPS = [", "INSTALLED_APPS = [*INSTALLED_APPS,", 1)
    settings_block = re.sub(r'CELERY_BROKER_URL = "[^"]*"', f'CELERY_BROKER_URL = "{broker}"', settings_block)
    # A queue of this run's own: two runs at once (two checkouts' tests) never take each other's messages.
    settings_block += f'CELERY_TASK_DEFAULT_QUEUE = "{queue}"\n'
    with (project / "proj" / "settings.py").open("a") as settings:
        settings.write("\n# --- from docs/tutorial/quickstart.md ---\n" + settings_block)

    urls_block = block_after(markdown, "proj/urls.py", "HTTP API")
    urls_block = urls_block.replace("urlpatterns = [\n    # ...\n", "urlpatterns = [\n    *urlpatterns,\n", 1)
    urls_block += 'urlpatterns.append(path("", include("chat.urls")))\n'  # "included from proj/urls.py"
    with (project / "proj" / "urls.py").open("a") as urls:
        urls.write("\n# --- from docs/tutorial/quickstart.md ---\n" + urls_block)

    (project / "proj" / "celery.py").write_text(block_after(markdown, "proj/celery.py"))
    (project / "proj" / "__init__.py").write_text(block_after(markdown, "proj/__init__.py"))
    (project / "chat" / "workflows.py").write_text(block_after(markdown, "chat/workflows.py"))
    (project / "chat" / "views.py").write_text(block_after(markdown, "chat/views.py"))
    (project / "chat" / "urls.py").write_text(block_after(markdown, "chat/urls.py"))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4])
