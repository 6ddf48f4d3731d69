"""API keys: the keys file (tenant and the groups each key covers) and the check of one request's key.

The package's docstring (``elasticmem/serve/__init__.py``) describes the server and its API.
"""

import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("elasticmem.serve")

@dataclass(frozen=True)
class ApiKey:
    """What one API key may do: the tenant it belongs to and the groups it may read and write."""

    tenant: str
    groups: tuple[str, ...]
    """``fnmatch`` patterns (case-sensitive): ``"tenantA/*"``, or an exact name."""

    def allows(self, group: str) -> bool:
        return any(fnmatch.fnmatchcase(group, pattern) for pattern in self.groups)


class KeysFileError(ValueError):
    """The API-keys file is unreadable or malformed; the message names the file and the entry."""


def load_api_keys(path: str | Path) -> dict[str, ApiKey]:
    """Read ``{"<key>": {"tenant": str, "groups": [pattern, ...]}}`` from JSON or YAML.

    Entries are named by position in errors, never by the key itself: the error may reach a log.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise KeysFileError(f"cannot read the API-keys file {path}: {e}") from e
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except Exception as e:  # json.JSONDecodeError or yaml.YAMLError: both say where
        raise KeysFileError(f"API-keys file {path} is not valid {path.suffix.lstrip('.') or 'JSON'}: {e}") from e
    if not isinstance(raw, dict) or not raw:
        raise KeysFileError(f"API-keys file {path} must map each key to {{tenant, groups}}; "
                            f"got {type(raw).__name__ if raw else 'nothing'}")
    keys: dict[str, ApiKey] = {}
    for i, (key, entry) in enumerate(raw.items()):
        where = f"API-keys file {path}, entry {i + 1}"
        if not isinstance(key, str) or len(key) < 8 or any(c.isspace() for c in key):
            raise KeysFileError(f"{where}: a key must be a string of at least 8 characters without spaces")
        if not isinstance(entry, dict) or set(entry) - {"tenant", "groups"}:
            raise KeysFileError(f"{where}: must be an object with 'tenant' and 'groups' only")
        tenant, groups = entry.get("tenant"), entry.get("groups")
        if not isinstance(tenant, str) or not tenant:
            raise KeysFileError(f"{where}: 'tenant' must be a non-empty string")
        if not isinstance(groups, list) or not all(isinstance(g, str) and g for g in groups):
            raise KeysFileError(f"{where} (tenant {tenant!r}): 'groups' must be a list of group names or patterns")
        keys[key] = ApiKey(tenant, tuple(groups))
    return keys



class AuthError(ValueError):
    """No, a malformed or an unknown API key (401)."""


def authenticate(keys: dict[str, ApiKey], authorization: str | None) -> ApiKey:
    """The key an ``Authorization`` header value names, or AuthError saying what is wrong with it."""
    if not authorization:
        raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthError("malformed Authorization header: send 'Authorization: Bearer <key>'")
    key = keys.get(token.strip())
    if key is None:
        raise AuthError("unknown API key")
    return key
