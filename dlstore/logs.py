"""Log output a user can read.

dlstore logs at the asked level, its libraries at WARNING. A run prints what it does, not every request, unless `-vv`."""

from __future__ import annotations

import importlib.util
import logging
import pkgutil
import re
from urllib.parse import urlsplit

__all__ = ["STORAGE_SECRETS", "THIRD_PARTY", "configure_logging", "redact_storage_secrets"]

# Loggers of the libraries under the storage layer. python-swiftclient logs every failed
# request at INFO, 404 probes included, with its curl line and headers.
THIRD_PARTY = ("swiftclient", "keystoneauth", "botocore", "boto3", "s3transfer", "urllib3", "fsspec", "PIL")

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(verbosity: int = 0, level: int | None = None) -> None:
    """Set up the root logger: WARNING, INFO with `verbosity=1`, DEBUG with 2, or `level`.
    Third-party loggers stay at WARNING below `verbosity=2`.

    >>> configure_logging(1)     # what `dlstore -v ...` does
    """
    if level is None:
        level = logging.WARNING - 10 * min(max(verbosity, 0), 2)
    logging.basicConfig(level=level, format=FORMAT)
    logging.getLogger().setLevel(level)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.DEBUG if verbosity >= 2 else logging.WARNING)


# Secrets the storage SDKs write into their log lines, and the loggers that write them. A filter
# sees only its own logger's records. swiftclient logs `X-Auth-Token`, botocore at DEBUG logs
# `x-amz-security-token`. Group 1 is what is kept before each secret.
STORAGE_SECRETS: tuple[tuple[tuple[str, ...], re.Pattern[str]], ...] = (
    (
        ("swiftclient",),
        re.compile(
            r"""(?ix)
            (x-(?:auth|storage|service|subject)-(?:token|key)   # header name
             ['"]?\s*[:=]\s*['"]?)                             # separator, maybe quoted (dict repr or curl -H)
            [^'"\s,}]+                                         # the value
            """
        ),
    ),
    (
        # Every botocore module's logger. botocore.parsers logs an error's body, which echoes
        # the canonical request of a wrong signature, token included.
        ("botocore", "botocore.auth", "botocore.endpoint", "botocore.awsrequest", "botocore.httpsession"),
        re.compile(r"""(?i)(x-amz-security-token['"]?\s*[:=]\s*b?['"]?)[^'"\s&,}<]+"""),
    ),
)


#: Loggers that print the URLs they open (fsspec's, at DEBUG): their URLs' credentials are hidden.
URL_LOGGERS = ("fsspec", "fsspec.http")


def _package_loggers(package: str) -> list[str]:
    """The logger names of `package`'s modules, found without importing it.
    A filter must sit on the very logger a record is made on."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return []
    return [f"{package}.{m.name}" for m in pkgutil.iter_modules(spec.submodule_search_locations)]


class _RedactSecrets(logging.Filter):
    """Replaces each secret `pattern` finds with `***`."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = self.pattern.sub(r"\1***", message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


def redact_storage_secrets() -> None:
    """Blank the `STORAGE_SECRETS` in the storage SDKs' log lines; idempotent.
    Importing `dlstore.storage` calls this before any client exists. So SDK calls made
    before the first store are covered too, a user's own swiftclient Connection say."""
    for loggers, pattern in STORAGE_SECRETS:
        names = dict.fromkeys([*loggers, *(n for p in loggers if "." not in p for n in _package_loggers(p))])
        for name in names:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _RedactSecrets) and f.pattern is pattern for f in logger.filters):
                logger.addFilter(_RedactSecrets(pattern))
    for name in URL_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _RedactUrls) for f in logger.filters):
            logger.addFilter(_RedactUrls())


def printable(text: str) -> str:
    """`text` with its control characters written as escapes, for a terminal.
    Names from a manifest or a tar are anyone's. A carriage return or an escape sequence
    in one could forge a line of output.

    >>> printable("shard\\r\\n\\x1b[2Jok")
    'shard\\\\r\\\\n\\\\x1b[2Jok'
    """
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


#: Query parameters of a URL that are credentials, or sign one: hidden in messages (lower case).
_SECRET_QUERY = re.compile(r"(signature|token|credential|password|secret|key|sig)$|^x-amz-|^x-goog-")


def redact_url(url: str) -> str:
    """`url` for messages, with its user's password and credential query values as `***`.
    A value that signs the request counts: S3 and GCS presigned URLs, Azure SAS tokens.

    >>> redact_url("http://alice:hunter2@host/data?X-Amz-Signature=abc&part=1")
    'http://alice:***@host/data?X-Amz-Signature=***&part=1'
    """
    if "@" not in url and "?" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        name, has_password, _ = user.partition(":")
        netloc = f"{name}:***@{host}" if has_password else f"{user}@{host}"
    query = "&".join(
        f"{name}=***" if value and _SECRET_QUERY.search(name.lower()) else (f"{name}={value}" if sep else name)
        for name, sep, value in (item.partition("=") for item in parts.query.split("&") if item)
    )
    return parts._replace(netloc=netloc, query=query).geturl()


def redact_urls_in(text: str) -> str:
    """`text`, an exception's say, with every URL in it as `redact_url` gives it."""
    return re.sub(r"[a-z][a-z0-9+.-]*://[^\s'\"<>]+", lambda found: redact_url(found[0]), text)


class _RedactUrls(logging.Filter):
    """Hides the credentials of every URL in a record, as `redact_urls_in` does.
    fsspec logs the URLs it opens at DEBUG, passwords and presigned signatures included."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_urls_in(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True
