"""Embedded default datasets, built offline from the docstrings of the Python standard library.

Every Python installation carries the same text, so the default data needs no download:
a FIXED, sorted list of standard-library modules is imported, and ``inspect.getdoc`` of
every public module, class, function, method and property defined there is collected.
Records are sorted by name, docstrings are de-duplicated (first name wins) and every random
choice comes from ``numpy.random.default_rng(SEED)``, so the datasets are identical for a
given Python version, whatever was imported before.

Four embedded datasets (``load_embedded(name)``):

- ``embedded-sft`` (alias ``embedded``): ``prompt``/``completion`` strings, e.g.
  ``{"prompt": "What does the function `json.dumps` do?\\n", "completion": "Serialize obj..."}``.
- ``embedded-messages``: the same examples as ``messages`` =
  ``[{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]``.
- ``embedded-preference``: ``prompt``/``chosen``/``rejected``; ``chosen`` is the docstring of
  the object named in the prompt, ``rejected`` a deterministic corruption (see
  ``corrupt_docstring``) that a tiny model learns to tell apart.
- ``embedded-text``: plain ``text`` (one docstring each), for language-model data.

Built datasets are cached as Parquet under ``cache_root()/embedded-py<X.Y.Z>-<hash>/``
where the hash covers the collected text and the build recipe (``CORPUS_VERSION``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import logging
import os
import platform
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

# numpy, pyarrow and twinseq itself are imported inside the functions that use them: this file
# also runs as the stdlib-only collector process (``python -I -S``), where they are not importable.
if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

CORPUS_VERSION = "1"
SEED = 1234
MIN_DOC_CHARS = 8

# Importable on every CPython >= 3.10 on Linux/macOS; a module missing on some platform is
# skipped with a log line (the content hash then differs, so caches never mix).
STDLIB_MODULES: tuple[str, ...] = tuple(
    sorted(
        """
abc argparse ast asyncio asyncio.base_events asyncio.events asyncio.futures asyncio.locks
asyncio.protocols asyncio.queues asyncio.streams asyncio.subprocess asyncio.tasks
asyncio.transports base64 bdb binascii bisect builtins bz2 calendar cmath cmd code codecs
codeop collections collections.abc colorsys concurrent.futures concurrent.futures.process
concurrent.futures.thread configparser contextlib copy copyreg csv dataclasses datetime
decimal difflib dis doctest email email.charset email.contentmanager email.encoders
email.feedparser email.generator email.header email.headerregistry email.message
email.mime.base email.mime.multipart email.mime.text email.parser email.policy email.utils
enum errno filecmp fileinput fnmatch fractions ftplib functools gc genericpath getopt
gettext glob graphlib gzip hashlib heapq hmac html html.parser http http.client
http.cookiejar http.cookies http.server imaplib importlib importlib.abc importlib.machinery
importlib.metadata importlib.resources importlib.util inspect io ipaddress itertools json
json.decoder json.encoder keyword linecache locale logging logging.config logging.handlers
lzma mailbox marshal math mimetypes multiprocessing multiprocessing.connection
multiprocessing.managers multiprocessing.pool multiprocessing.process multiprocessing.queues
multiprocessing.shared_memory multiprocessing.synchronize netrc numbers opcode operator
optparse os pathlib pdb pickle pickletools pkgutil platform plistlib poplib posixpath pprint
profile pstats pyclbr pydoc queue quopri random re reprlib rlcompleter runpy sched secrets
select selectors shelve shlex shutil signal smtplib socket socketserver statistics string
stringprep struct subprocess symtable sys sysconfig tabnanny tarfile tempfile textwrap
threading time timeit tokenize trace traceback tracemalloc types typing unicodedata unittest
unittest.case unittest.loader unittest.mock unittest.result unittest.runner unittest.suite
urllib.error urllib.parse urllib.request urllib.response urllib.robotparser uuid warnings
wave weakref xml.dom xml.dom.minidom xml.dom.pulldom xml.etree.ElementTree xml.parsers.expat
xml.sax xml.sax.handler xml.sax.saxutils xml.sax.xmlreader zipapp zipfile zipimport zlib
zoneinfo
""".split()
    )
)

PROMPT_TEMPLATES: tuple[str, ...] = (
    "Explain `{name}`.",
    "What does the {kind} `{name}` do?",
    "Write the docstring of the {kind} `{name}` from the `{module}` module.",
    "Document `{name}{params}`.",
    "In Python's standard library, what is `{name}` for?",
)

EMBEDDED_NAMES = {
    "embedded": "sft",
    "embedded-sft": "sft",
    "embedded-messages": "messages",
    "embedded-preference": "preference",
    "embedded-text": "text",
}


@dataclass(frozen=True)
class DocRecord:
    """One documented object: ``kind`` in module/class/function/method/property."""

    kind: str
    name: str
    module: str
    params: str
    doc: str


# --------------------------------------------------------------------------------------
# Collection
# --------------------------------------------------------------------------------------


def _param_names(obj: object) -> str:
    """``(obj, *, skipkeys)``: parameter names only, so no memory address leaks into the text."""
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    names = []
    for p in sig.parameters.values():
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")  # type: ignore[call-overload]
        names.append(prefix + p.name)
    return "(" + ", ".join(names) + ")"


def _defined_in(obj: object, module_name: str) -> bool:
    """True for objects defined in ``module_name`` or in its C accelerator (``_json`` for ``json``)."""
    owner = getattr(obj, "__module__", None)
    if not isinstance(owner, str):
        return False
    if owner == module_name:
        return True
    return not inspect.isclass(obj) and owner.startswith("_")


def _member_records(cls: type, qualname: str, module_name: str) -> Iterator[DocRecord]:
    for attr in sorted(vars(cls)):
        if attr.startswith("_"):
            continue
        member = vars(cls)[attr]
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isroutine(member):
            kind, params = "method", _param_names(member)
        elif isinstance(member, property) or inspect.isdatadescriptor(member):
            kind, params = "property", ""
        else:
            continue
        doc = inspect.getdoc(member)
        if doc:
            yield DocRecord(kind, f"{qualname}.{attr}", module_name, params, doc)


def _module_records(module_name: str) -> Iterator[DocRecord]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
    doc = inspect.getdoc(module)
    if doc:
        yield DocRecord("module", module_name, module_name, "", doc)
    namespace = vars(module)
    for name in sorted(namespace):
        obj = namespace[name]
        if name.startswith("_") or not (inspect.isroutine(obj) or inspect.isclass(obj)):
            continue
        if not _defined_in(obj, module_name):
            continue
        qualname = f"{module_name}.{name}"
        doc = inspect.getdoc(obj)
        if doc:
            kind = "class" if inspect.isclass(obj) else "function"
            yield DocRecord(kind, qualname, module_name, _param_names(obj), doc)
        if inspect.isclass(obj):
            yield from _member_records(obj, qualname, module_name)


def _collect_here(modules: tuple[str, ...]) -> list[DocRecord]:
    records: list[DocRecord] = []
    for module_name in sorted(modules):
        try:
            records.extend(_module_records(module_name))
        except ImportError as err:
            logger.info("embedded corpus: skipping module %s, not importable here (%s)", module_name, err)
    records.sort(key=lambda r: (r.name, r.kind))
    seen: set[str] = set()
    unique = []
    for rec in records:
        doc = rec.doc.strip()
        if len(doc) < MIN_DOC_CHARS or doc in seen:
            continue
        seen.add(doc)
        unique.append(DocRecord(rec.kind, rec.name, rec.module, rec.params, doc))
    return unique


def _subprocess_main() -> None:
    """Entry point of the clean collector process: JSON records on stdout."""
    import sys

    modules = tuple(json.loads(sys.stdin.read()))
    json.dump([list(r.__dict__.values()) for r in _collect_here(modules)], sys.stdout)


@functools.lru_cache(maxsize=4)
def collect_docstrings(modules: tuple[str, ...] = STDLIB_MODULES) -> tuple[DocRecord, ...]:
    """All docstrings of ``modules``, sorted by name, one record per distinct docstring.

    Collected in a fresh ``python -I -S`` process (stdlib only): libraries imported by the
    caller monkeypatch the stdlib (transformers adds ``logging.Logger.warning_once``, torch
    replaces ``inspect.getfile``), which would change the text. Docstrings shorter than
    ``MIN_DOC_CHARS`` characters are dropped.
    """
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('corpus', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); sys.modules['corpus'] = m; spec.loader.exec_module(m); "
        "m._subprocess_main()"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code, __file__],
        input=json.dumps(modules),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"collecting stdlib docstrings failed in a subprocess:\n{proc.stderr[-2000:]}")
    return tuple(DocRecord(*fields) for fields in json.loads(proc.stdout))


def content_hash(records: Sequence[DocRecord]) -> str:
    """sha256 (16 hex digits) over the collected text and the build recipe."""
    h = hashlib.sha256()
    h.update(json.dumps([CORPUS_VERSION, SEED, PROMPT_TEMPLATES, MIN_DOC_CHARS]).encode())
    for rec in records:
        h.update(json.dumps([rec.kind, rec.name, rec.module, rec.params, rec.doc]).encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------
# Dataset construction
# --------------------------------------------------------------------------------------


def _prompt(rec: DocRecord, template: str) -> str:
    return template.format(name=rec.name, kind=rec.kind, module=rec.module, params=rec.params or "") + "\n"


_WORD_RE = re.compile(r"\S+")


def corrupt_docstring(doc: str, rng: np.random.Generator) -> str:
    """The ``rejected`` answer: the docstring's words in a random order, joined by spaces.

    Same vocabulary and about the same token count as ``chosen``, but no grammar and no
    line structure, so a preference for ``chosen`` is learnable from local token order alone.

    >>> corrupt_docstring("Return the sum of a and b.", np.random.default_rng(0))  # doctest: +SKIP
    'b. sum Return and a of the'
    """
    import numpy as np

    words = _WORD_RE.findall(doc)
    if len(words) < 2:
        return doc[::-1]
    order = rng.permutation(len(words))
    if (order == np.arange(len(words))).all():
        order = np.roll(order, 1)
    return " ".join(words[i] for i in order)


def build_rows(records: Sequence[DocRecord], seed: int = SEED) -> dict[str, list[dict]]:
    """All four embedded datasets as lists of row dicts, in one seeded shuffled order.

    The order is shuffled once so that consecutive rows come from different modules.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    template_idx = rng.integers(len(PROMPT_TEMPLATES), size=len(records))
    order = rng.permutation(len(records))
    sft, messages, preference, text = [], [], [], []
    for i in order.tolist():
        rec = records[i]
        prompt = _prompt(rec, PROMPT_TEMPLATES[template_idx[i]])
        sft.append({"prompt": prompt, "completion": rec.doc})
        messages.append(
            {"messages": [{"role": "user", "content": prompt.rstrip("\n")}, {"role": "assistant", "content": rec.doc}]}
        )
        preference.append({"prompt": prompt, "chosen": rec.doc, "rejected": corrupt_docstring(rec.doc, rng)})
        text.append({"text": rec.doc})
    return {"sft": sft, "messages": messages, "preference": preference, "text": text}


# --------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$TWINSEQ_CACHE`` or ``~/.cache/twinseq``."""
    return Path(os.environ.get("TWINSEQ_CACHE") or Path.home() / ".cache" / "twinseq").expanduser()


def python_tag() -> str:
    return "py" + platform.python_version()


def _write_parquet_atomic(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)  # atomic: parallel builders never see a half-written file


def embedded_dir(records: Sequence[DocRecord] | None = None) -> Path:
    """The cache folder of the embedded datasets, built on first use (about a second)."""
    records = collect_docstrings() if records is None else records
    folder = cache_root() / f"embedded-{python_tag()}-{content_hash(records)}"
    if all((folder / f"{kind}.parquet").is_file() for kind in set(EMBEDDED_NAMES.values())):
        return folder
    logger.info("building the embedded datasets from %d stdlib docstrings into %s", len(records), folder)
    folder.mkdir(parents=True, exist_ok=True)
    for kind, rows in build_rows(records).items():
        _write_parquet_atomic(rows, folder / f"{kind}.parquet")
    return folder


def load_embedded(name: str = "embedded-sft"):
    """One embedded dataset as a ``datasets.Dataset`` (``EMBEDDED_NAMES`` lists the names)."""
    if name not in EMBEDDED_NAMES:
        from twinseq.common.errors import DataError  # stdlib-only module: it also runs as a clean script

        raise DataError(f"embedded dataset {name!r} is unknown; choose one of {sorted(EMBEDDED_NAMES)}.")
    import pyarrow.parquet as pq
    from datasets import Dataset
    from datasets.table import InMemoryTable

    table = pq.read_table(embedded_dir() / f"{EMBEDDED_NAMES[name]}.parquet")
    return Dataset(InMemoryTable(table))


def tokenizer_training_texts(records: Sequence[DocRecord] | None = None) -> list[str]:
    """The text the embedded tokenizer is trained on: every docstring and every prompt, in order."""
    records = collect_docstrings() if records is None else records
    rows = build_rows(records)["sft"]
    return [r["prompt"] for r in rows] + [r["completion"] for r in rows]
