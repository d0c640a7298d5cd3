"""Which credentials the environment holds for a store, and which variables supply them.

Values are shown for names and URLs. Secrets are `dlstore.config.Secret`s, shown only as `***`.
"""

from __future__ import annotations

from collections.abc import Mapping

from dlstore.config import Secret, StoreConfig
from dlstore.doctor.check import FAIL, OK, WARN, Check

__all__ = ["credentials_check", "s3_credentials_check", "swift_credentials_check"]

_SWIFT_FIX = (
    "source your project's openrc (OS_AUTH_URL, OS_USERNAME, OS_PASSWORD, OS_PROJECT_NAME, ... or an "
    "application credential's OS_APPLICATION_CREDENTIAL_ID/_SECRET), or export ST_AUTH, ST_USER, ST_KEY (v1 auth)"
)
_S3_FIX = (
    "export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (on OpenStack: `openstack ec2 credentials create`) "
    "and AWS_ENDPOINT_URL, or AWS_PROFILE naming a profile in ~/.aws/credentials"
)


def _shown(env: Mapping[str, str], names: tuple[str, ...], secrets: Mapping[str, Secret | None]) -> str:
    """`NAME=value` for the names set in `env`; secrets show through their `Secret` as `***`."""
    parts = []
    for name in names:
        if not env.get(name):
            continue
        parts.append(f"{name}={secrets[name]}" if name in secrets else f"{name}={env[name]}")
    return " ".join(parts)


def swift_credentials_check(env: Mapping[str, str], config: StoreConfig) -> Check:
    """The set `SwiftConfig.from_env` uses: `ST_*` when `ST_AUTH` is set, else an openrc's `OS_*`.
    Failing both, a pre-authenticated `OS_STORAGE_URL` and `OS_AUTH_TOKEN`."""
    cfg = config.swift
    secrets = {
        "ST_KEY": cfg.key,
        "OS_PASSWORD": cfg.key,
        "OS_APPLICATION_CREDENTIAL_SECRET": cfg.application_credential_secret,
        "OS_AUTH_TOKEN": cfg.auth_token,
    }
    if env.get("ST_AUTH"):
        shown = _shown(env, ("ST_AUTH", "ST_USER", "ST_KEY"), secrets)
        missing = [name for name in ("ST_USER", "ST_KEY") if not env.get(name)]
        if missing:
            return Check("credentials", FAIL, f"Swift v1: ST_AUTH is set but {', '.join(missing)} not", _SWIFT_FIX)
        if env.get("OS_AUTH_URL"):
            return Check(
                "credentials",
                WARN,
                f"Swift v1 from {shown}; the OS_* variables of an openrc are set too and ignored",
                "unset ST_AUTH ST_USER ST_KEY to use the openrc (the swift CLI mixes the two sets differently)",
            )
        return Check("credentials", OK, f"Swift v1 (tempauth/swauth) from {shown}")
    if env.get("OS_AUTH_URL"):
        return _keystone_check(env, cfg.auth_version, secrets)
    if env.get("OS_STORAGE_URL") and env.get("OS_AUTH_TOKEN"):
        return Check(
            "credentials",
            WARN,
            f"Swift pre-authenticated token from {_shown(env, ('OS_STORAGE_URL', 'OS_AUTH_TOKEN'), secrets)}",
            "a token alone expires (often after a day) and cannot be renewed: for long runs "
            "give the credentials too (an openrc or ST_*)",
        )
    return Check("credentials", FAIL, "no Swift credentials in the environment", _SWIFT_FIX)


def _keystone_check(env: Mapping[str, str], version: str, secrets: Mapping[str, Secret | None]) -> Check:
    if env.get("OS_APPLICATION_CREDENTIAL_ID"):
        method = "application credential"
        names: tuple[str, ...] = ("OS_AUTH_URL", "OS_APPLICATION_CREDENTIAL_ID", "OS_APPLICATION_CREDENTIAL_SECRET")
        required = names
    else:
        method = "password"
        names = ("OS_AUTH_URL", "OS_USERNAME", "OS_PASSWORD", "OS_PROJECT_NAME", "OS_PROJECT_ID", "OS_TENANT_NAME")
        required = ("OS_AUTH_URL", "OS_USERNAME", "OS_PASSWORD")
    names += ("OS_USER_DOMAIN_NAME", "OS_PROJECT_DOMAIN_NAME", "OS_REGION_NAME", "OS_INTERFACE")
    missing = [name for name in required if not env.get(name)]
    if method == "password" and not any(env.get(n) for n in ("OS_PROJECT_NAME", "OS_PROJECT_ID", "OS_TENANT_NAME")):
        missing.append("OS_PROJECT_NAME (or OS_PROJECT_ID)")
    what = f"Keystone v{version} {method}"
    if missing:
        return Check("credentials", FAIL, f"{what}: {', '.join(missing)} not set", _SWIFT_FIX)
    return Check("credentials", OK, f"{what} from {_shown(env, names, secrets)}")


def s3_credentials_check(env: Mapping[str, str], config: StoreConfig) -> Check:
    """Keys from `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`, else boto3's own chain.
    That chain reads profiles, the shared credentials file and instance metadata."""
    cfg = config.s3
    secrets = {"AWS_SECRET_ACCESS_KEY": cfg.secret_access_key, "AWS_SESSION_TOKEN": cfg.session_token}
    has_id, has_secret = bool(env.get("AWS_ACCESS_KEY_ID")), bool(env.get("AWS_SECRET_ACCESS_KEY"))
    if has_id != has_secret:
        absent = "AWS_SECRET_ACCESS_KEY" if has_id else "AWS_ACCESS_KEY_ID"
        return Check("credentials", FAIL, f"S3: {absent} is not set, its partner is", _S3_FIX)
    if has_id:
        names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
        return Check("credentials", OK, f"S3 keys from {_shown(env, names, secrets)}")
    return _boto3_chain_check(cfg.profile)


def _boto3_chain_check(profile: str | None) -> Check:
    # boto3 is the s3:// backend's optional dependency: imported only for s3:// URLs.
    try:
        import boto3
        import botocore.exceptions
    except ImportError:
        return Check("credentials", FAIL, "s3:// needs boto3, which is not installed", "pip install boto3")
    try:
        found = boto3.session.Session(profile_name=profile).get_credentials()
    except botocore.exceptions.ProfileNotFound:
        return Check("credentials", FAIL, f"AWS_PROFILE={profile} is not in the AWS config files", _S3_FIX)
    except botocore.exceptions.BotoCoreError as exc:
        return Check("credentials", FAIL, f"S3: boto3 cannot read its credentials ({type(exc).__name__})", _S3_FIX)
    if found is None:
        return Check("credentials", FAIL, "no S3 credentials (environment, profiles, instance metadata)", _S3_FIX)
    source = f"profile {profile}" if profile else "boto3's default chain"
    return Check("credentials", OK, f"S3 credentials from {source} ({found.method})")


def credentials_check(scheme: str | None, env: Mapping[str, str], config: StoreConfig) -> list[Check]:
    """The credential check for `scheme`; without a URL, one per backend whose variables are set."""
    if scheme == "swift":
        return [swift_credentials_check(env, config)]
    if scheme == "s3":
        return [s3_credentials_check(env, config)]
    if scheme == "file":
        return [Check("credentials", OK, "file:// needs none")]
    if scheme is not None:
        if not _fsspec_knows(scheme):  # else a typo such as `swfit://` would pass as fsspec's
            return [Check("credentials", FAIL, f"no storage backend reads {scheme}:// URLs", "check the URL's scheme")]
        return [Check("credentials", OK, f"{scheme}:// is fsspec's: it reads its own settings")]
    found = []
    if any(env.get(n) for n in ("ST_AUTH", "OS_AUTH_URL", "OS_STORAGE_URL")):
        found.append(swift_credentials_check(env, config))
    if any(env.get(n) for n in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE")):
        found.append(s3_credentials_check(env, config))
    if not found:
        found.append(
            Check(
                "credentials",
                WARN,
                "no Swift (ST_*, OS_*) or S3 (AWS_*) credentials in the environment",
                f"for swift://: {_SWIFT_FIX}; for s3://: {_S3_FIX}",
            )
        )
    return found


def _fsspec_knows(scheme: str) -> bool:
    try:
        import fsspec
    except ImportError:
        return False
    return scheme in fsspec.available_protocols()
