"""Documents in formats other than text (context.documents): HTML, PDF and Word's .docx, read as
text through well-kept libraries, the optional extra `pip install 'spds[documents]'`: html2text
(HTML to plain text, its links and images left out), pypdf (each page's text, pages a blank line
apart) and python-docx (each paragraph a line). Without the extra such a file is refused, naming
the command that installs it. What each library yields depends on its version: the corpus's
digest names it (spds/contract/documents.py), so an upgrade that could change the text stops a
pinned run before any work."""

from __future__ import annotations

from pathlib import Path

from spds.contract.documents import CONVERTED
from spds.errors import SpdsError


def converted_text(path: Path) -> str:
    """The text of an HTML, PDF or .docx document."""
    suffix = path.suffix.lower()
    distribution, module = CONVERTED[suffix]
    try:
        library = __import__(module)
    except ImportError:
        raise SpdsError(
            f"{path}: rule 'a format spds reads': a {suffix} document is read through {distribution}, which is not "
            "installed: pip install 'spds[documents]'"
        ) from None
    try:
        if suffix == ".pdf":
            return "\n\n".join((page.extract_text() or "").strip() for page in library.PdfReader(str(path)).pages)
        if suffix == ".docx":
            return "\n".join(paragraph.text for paragraph in library.Document(str(path)).paragraphs)
        reader = library.HTML2Text()
        reader.ignore_links, reader.ignore_images, reader.body_width = True, True, 0
        return reader.handle(path.read_bytes().decode("utf-8", errors="replace"))
    except Exception as error:  # noqa: BLE001 (a damaged file of that format: named, never a traceback)
        raise SpdsError(
            f"{path}: rule 'a readable {suffix} document': {distribution} cannot read it ({type(error).__name__}: "
            f"{str(error)[:160]})"
        ) from None
