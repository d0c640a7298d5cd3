"""SwiftConfig / S3Config / StoreConfig from an environment mapping, Secret, parse_size."""

from __future__ import annotations

import logging
import pickle

import pytest

from dlstore.config import (
    DataConfig,
    RetryConfig,
    S3Config,
    Secret,
    StoreConfig,
    SwiftConfig,
    TransformConfig,
    parse_size,
    writable_dir,
)
from dlstore.errors import ConfigError

OPENRC_V3_PASSWORD = {
    "OS_AUTH_URL": "https://keystone.example.org:5000/v3",
    "OS_IDENTITY_API_VERSION": "3",
    "OS_USERNAME": "alice",
    "OS_PASSWORD": "pw-7f3a9c",
    "OS_PROJECT_NAME": "ml-team",
    "OS_PROJECT_ID": "0123abcd",
    "OS_USER_DOMAIN_NAME": "Users",
    "OS_PROJECT_DOMAIN_NAME": "Projects",
    "OS_REGION_NAME": "RegionTwo",
    "OS_INTERFACE": "public",
}

OPENRC_APP_CRED = {
    "OS_AUTH_TYPE": "v3applicationcredential",
    "OS_AUTH_URL": "https://keystone.example.org:5000/v3",
    "OS_IDENTITY_API_VERSION": "3",
    "OS_APPLICATION_CREDENTIAL_ID": "6d8b1f0e",
    "OS_APPLICATION_CREDENTIAL_SECRET": "appsecret-42e1",
    "OS_REGION_NAME": "RegionOne",
    "OS_INTERFACE": "public",
}

ST_ENV = {"ST_AUTH": "http://127.0.0.1:8080/auth/v1.0", "ST_USER": "test:tester", "ST_KEY": "st-key-9b2"}


# -- SwiftConfig ---------------------------------------------------------------------------------
def test_swift_v1_from_st_variables():
    config = SwiftConfig.from_env(ST_ENV)
    assert config.auth_url == ST_ENV["ST_AUTH"]
    assert config.auth_version == "1.0"
    assert config.user == "test:tester"
    assert config.key == Secret("st-key-9b2")
    assert config.application_credential_id is None


def test_st_variables_win_over_an_openrc():
    config = SwiftConfig.from_env({**OPENRC_V3_PASSWORD, **ST_ENV})
    assert (config.auth_url, config.auth_version, config.user) == (ST_ENV["ST_AUTH"], "1.0", "test:tester")
    assert config.key.reveal() == "st-key-9b2"
    assert config.project_name is None


def test_swift_v3_password_from_an_openrc():
    config = SwiftConfig.from_env(OPENRC_V3_PASSWORD)
    assert config.auth_url == OPENRC_V3_PASSWORD["OS_AUTH_URL"]
    assert config.auth_version == "3"
    assert (config.user, config.key.reveal()) == ("alice", "pw-7f3a9c")
    assert (config.project_name, config.project_id) == ("ml-team", "0123abcd")
    assert (config.user_domain_name, config.project_domain_name) == ("Users", "Projects")
    assert (config.region_name, config.interface) == ("RegionTwo", "public")


def test_openrc_defaults_and_legacy_names():
    env = {
        "OS_AUTH_URL": "https://keystone.example.org:5000/v3",
        "OS_USERNAME": "bob",
        "OS_PASSWORD": "pw",
        "OS_TENANT_NAME": "legacy-project",
        "OS_ENDPOINT_TYPE": "internalURL",
    }
    config = SwiftConfig.from_env(env)
    assert config.auth_version == "3"  # OS_AUTH_URL without OS_IDENTITY_API_VERSION
    assert config.project_name == "legacy-project"
    assert config.interface == "internalURL"
    assert (config.user_domain_name, config.project_domain_name) == ("Default", "Default")


def test_swift_v3_application_credential_from_an_openrc():
    config = SwiftConfig.from_env(OPENRC_APP_CRED)
    assert config.auth_version == "3"
    assert config.application_credential_id == "6d8b1f0e"
    assert config.application_credential_secret.reveal() == "appsecret-42e1"
    assert config.user is None and config.key is None
    # Domains belong to users and projects; an application credential has them built in.
    assert config.user_domain_name is None and config.project_domain_name is None


def test_swift_preauthenticated_and_tls_settings():
    env = {
        "OS_STORAGE_URL": "https://swift.example.org/v1/AUTH_abc",
        "OS_AUTH_TOKEN": "gAAAAtoken",
        "OS_CACERT": "/etc/ssl/site-ca.pem",
        "SWIFTCLIENT_INSECURE": "true",
        "DLSTORE_SEGMENT_SIZE": "256MiB",
    }
    config = SwiftConfig.from_env(env)
    assert config.storage_url == "https://swift.example.org/v1/AUTH_abc"
    assert config.auth_token.reveal() == "gAAAAtoken"
    assert config.cacert == "/etc/ssl/site-ca.pem"
    assert config.insecure is True
    assert config.segment_size == 256 * 2**20


def test_swift_empty_environment():
    config = SwiftConfig.from_env({})
    assert config.auth_url is None and config.key is None and config.storage_url is None
    assert config.auth_version == "1.0"
    assert config.segment_size == 64 * 2**20
    assert config.segment_container_suffix == "_segments"


def test_an_explicit_mapping_ignores_the_process_environment(monkeypatch):
    monkeypatch.setenv("ST_AUTH", "http://elsewhere/auth/v1.0")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://elsewhere:9000")
    config = StoreConfig.from_env(OPENRC_APP_CRED)
    assert config.swift.auth_url == OPENRC_APP_CRED["OS_AUTH_URL"]
    assert config.s3.endpoint_url is None


def test_a_swift_store_without_credentials_is_a_config_error():
    from dlstore.storage.swift import SwiftStore

    with pytest.raises(ConfigError, match="ST_AUTH"):
        SwiftStore("swift://container/prefix", StoreConfig(swift=SwiftConfig.from_env({})))


# -- S3Config ------------------------------------------------------------------------------------
def test_s3_from_aws_variables():
    env = {
        "AWS_ENDPOINT_URL": "http://127.0.0.1:8080",
        "AWS_ACCESS_KEY_ID": "test:tester",
        "AWS_SECRET_ACCESS_KEY": "aws-secret-1c9",
        "AWS_SESSION_TOKEN": "session-tok",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_PROFILE": "training",
        "AWS_CA_BUNDLE": "/etc/ssl/ca.pem",
        "DLSTORE_SEGMENT_SIZE": "5MB",
        "DLSTORE_S3_LIST_PAGE_SIZE": "99",
    }
    config = S3Config.from_env(env)
    assert config.endpoint_url == "http://127.0.0.1:8080"
    assert config.access_key_id == "test:tester"
    assert config.secret_access_key.reveal() == "aws-secret-1c9"
    assert config.session_token.reveal() == "session-tok"
    assert (config.region, config.profile, config.ca_bundle) == ("us-east-1", "training", "/etc/ssl/ca.pem")
    assert config.multipart_chunk_size == config.multipart_threshold == 5_000_000
    assert config.list_page_size == 99
    assert config.addressing_style == "path"
    assert config.checksum_when_required is True


def test_s3_endpoint_and_region_precedence():
    env = {
        "AWS_ENDPOINT_URL": "http://generic:1",
        "AWS_ENDPOINT_URL_S3": "http://s3-specific:2",
        "AWS_REGION": "eu-west-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    assert S3Config.from_env(env).endpoint_url == "http://s3-specific:2"
    assert S3Config.from_env(env).region == "eu-west-1"
    assert S3Config.from_env({**env, "DLSTORE_S3_ENDPOINT_URL": "http://ours:3"}).endpoint_url == "http://ours:3"


def test_s3_empty_environment_leaves_boto3_its_own_chain():
    config = S3Config.from_env({})
    assert config.endpoint_url is None and config.access_key_id is None and config.secret_access_key is None
    assert config.list_page_size == 1000


def test_s3_bad_page_size_is_a_config_error():
    with pytest.raises(ConfigError, match="DLSTORE_S3_LIST_PAGE_SIZE"):
        S3Config.from_env({"DLSTORE_S3_LIST_PAGE_SIZE": "many"})


def test_retry_from_env():
    config = RetryConfig.from_env({"DLSTORE_RETRY_ATTEMPTS": "3", "DLSTORE_RETRY_DEADLINE": "7.5"})
    assert (config.max_attempts, config.deadline_s) == (3, 7.5)
    with pytest.raises(ConfigError):
        RetryConfig.from_env({"DLSTORE_RETRY_ATTEMPTS": "three"})


# -- Secret --------------------------------------------------------------------------------------
SECRET_TEXT = "s3cr3t-do-not-print"


def test_secret_never_shows_itself(caplog):
    secret = Secret(SECRET_TEXT)
    shown = [
        repr(secret),
        str(secret),
        f"{secret}",
        f"{secret!r}",
        f"{secret:>30}",
        "%s %r" % (secret, secret),  # noqa: UP031 - the old formatting is what logging uses
        "{}".format(secret),  # noqa: UP032
        repr([secret]),
        repr({"key": secret}),
    ]
    for text in shown:
        assert SECRET_TEXT not in text
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("dlstore.test").warning("key=%s token=%r", secret, secret)
    assert SECRET_TEXT not in caplog.text
    assert secret.reveal() == SECRET_TEXT


def test_secret_hidden_in_config_reprs():
    store = StoreConfig(
        s3=S3Config(secret_access_key=Secret(SECRET_TEXT), session_token=Secret(SECRET_TEXT)),
        swift=SwiftConfig(
            key=Secret(SECRET_TEXT),
            application_credential_secret=Secret(SECRET_TEXT),
            auth_token=Secret(SECRET_TEXT),
        ),
    )
    for text in (repr(store), str(store), repr(store.swift), repr(store.s3), f"{store}"):
        assert SECRET_TEXT not in text
    for env in (ST_ENV, OPENRC_V3_PASSWORD, OPENRC_APP_CRED):
        config = StoreConfig.from_env({**env, "AWS_SECRET_ACCESS_KEY": SECRET_TEXT})
        text = repr(config)
        for name in ("ST_KEY", "OS_PASSWORD", "OS_APPLICATION_CREDENTIAL_SECRET"):
            if name in env:
                assert env[name] not in text
        assert SECRET_TEXT not in text


def test_secrets_given_as_plain_strings_are_wrapped():
    """`SwiftConfig(auth_token="t")`, as the Swift store's own docstring shows it: the token was
    in the config's repr, and the first request failed with an AttributeError."""
    store = StoreConfig(
        s3=S3Config(secret_access_key=SECRET_TEXT, session_token=SECRET_TEXT),
        swift=SwiftConfig(key=SECRET_TEXT, application_credential_secret=SECRET_TEXT, auth_token=SECRET_TEXT),
    )
    assert SECRET_TEXT not in repr(store)
    assert store.swift.auth_token.reveal() == store.s3.session_token.reveal() == SECRET_TEXT


def test_a_live_swift_token_is_not_in_the_stores_state_reprs():
    from dlstore.storage.swift.auth import SwiftToken as _Token

    assert SECRET_TEXT not in repr(_Token("http://127.0.0.1/v1/AUTH_x", SECRET_TEXT, proven=True))


def test_secret_equality_truthiness_and_pickle():
    assert Secret("a") == Secret("a")
    assert Secret("a") != Secret("b")
    assert Secret("a") != "a"
    assert not Secret("")
    assert Secret("x")
    assert pickle.loads(pickle.dumps(Secret(SECRET_TEXT))).reveal() == SECRET_TEXT
    assert len({Secret("a"), Secret("a")}) == 1


# -- parse_size ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("150GB", 150 * 10**9),
        ("64MiB", 64 * 2**20),
        ("64mib", 64 * 2**20),
        ("5M", 5 * 2**20),
        ("5MB", 5 * 10**6),
        ("1.5KB", 1500),
        ("2KiB", 2048),
        ("1T", 2**40),
        (" 10 MB ", 10**7),
        ("1048576", 1048576),
        ("100B", 100),
        (1048576, 1048576),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "MB", "5XB", "1.2.3MB", "5 PB"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="size"):
        parse_size(text)


# -- DataConfig: one data config for the dataset, the loader, the trainer and the bench -------------
def test_data_config_validates_where_defined():
    with pytest.raises(ConfigError, match="decode_on"):
        DataConfig("file:///x", decode_on="gpu")
    with pytest.raises(ConfigError, match="image_size"):
        DataConfig("file:///x", transform=TransformConfig("eval", 128), image_size=224)
    with pytest.raises(ConfigError, match="shuffle_window"):
        DataConfig("file:///x", shuffle_window=0)
    with pytest.raises(ConfigError, match="size"):
        DataConfig("file:///x", cache_limit="lots")
    cfg = DataConfig("file:///x", transform="eval", image_size=96, cache_limit="2GB")
    assert cfg.transform == TransformConfig("eval", 96) and cfg.cache_limit == 2 * 10**9
    # A new size alone resizes the transform; a new transform alone brings its size.
    assert cfg.replace(image_size=64).transform == TransformConfig("eval", 64)
    assert cfg.replace(transform=TransformConfig("train", 32)).image_size == 32


def test_data_config_reads_the_environment_only_in_from_env():
    env = {
        "DLSTORE_CACHE_DIR": "/scratch/cache",
        "ST_AUTH": "http://h/auth/v1.0",
        "ST_USER": "u",
        "ST_KEY": "hunter2-key",
    }
    cfg = DataConfig.from_env("swift://c/ds", env, batch_size=64)
    assert cfg.cache_dir == "/scratch/cache" and cfg.store.swift.user == "u" and cfg.batch_size == 64
    assert DataConfig("swift://c/ds").store is None and DataConfig("swift://c/ds").cache_dir == ""
    # Saved configs carry no credentials, and read back equal.
    saved = cfg.to_dict()
    assert "store" not in saved and "hunter2-key" not in repr(saved) + repr(cfg)
    assert DataConfig.from_dict(saved) == cfg


def test_a_data_setting_reaches_train_and_bench_from_one_flag():
    # --shuffle-window is one DataConfig field and one DATA_FLAGS line; both commands take it.
    from dlstore.bench import BenchConfig
    from dlstore.cli import build_parser
    from dlstore.cli.apps import BENCH_OWN_SETTINGS as _BENCH_OWN
    from dlstore.train.config import config_from_args

    train = build_parser().parse_args(["train", "file:///d/train", "--shuffle-window", "7", "--image-size", "96"])
    cfg = config_from_args(train, env={})
    assert (cfg.data.shuffle_window, cfg.data.image_size) == (7, 96)
    bench = build_parser().parse_args(["bench", "file:///d/train", "--shuffle-window", "7", "--workers", "1,2"])
    data = DataConfig.from_args(bench.url, bench, env={}, exclude=_BENCH_OWN)
    assert BenchConfig(data, workers=(1, 2)).data.shuffle_window == 7 and data.workers is None


def test_the_fetch_settings_reach_the_cache_from_one_flag_each():
    # --fetch-parts, --fetch-shards and --fetch-part-size: DataConfig fields that train and bench
    # both take, and that Dataset hands to its CacheConfig; left out, the cache's defaults hold.
    from dlstore.bench import BenchConfig
    from dlstore.cache import CacheConfig
    from dlstore.cli import build_parser
    from dlstore.cli.apps import BENCH_OWN_SETTINGS as _BENCH_OWN
    from dlstore.dataset import fetch_settings
    from dlstore.train.config import config_from_args

    flags = ["--fetch-parts", "3", "--fetch-shards", "5", "--fetch-part-size", "4MiB"]
    train = config_from_args(build_parser().parse_args(["train", "file:///d/train", *flags]), env={})
    bench = build_parser().parse_args(["bench", "file:///d/train", *flags])
    data = BenchConfig(DataConfig.from_args(bench.url, bench, env={}, exclude=_BENCH_OWN)).data
    for cfg in (train.data, data):
        cache = CacheConfig("/tmp/cache", "1GB", **fetch_settings(cfg))
        assert (cache.parts_in_flight, cache.shards_in_flight, cache.part_size) == (3, 5, 4 * 2**20)
    defaults = CacheConfig("/tmp/cache", "1GB", **fetch_settings(DataConfig("file:///d/train")))
    assert defaults == CacheConfig("/tmp/cache", "1GB")
    assert DataConfig.from_dict(train.data.to_dict()) == train.data  # saved with the run's config
    with pytest.raises(ConfigError):
        DataConfig("file:///d/train", fetch_parts=0)


def test_the_node_connection_cap_reaches_the_cache_from_one_flag():
    # --fetch-node-connections: the cap on the connections of all a node's ranks together
    # (CacheConfig.node_connections), from train and bench alike; 0 turns it off.
    from dlstore.bench import BenchConfig
    from dlstore.cache import CacheConfig
    from dlstore.cli import build_parser
    from dlstore.cli.apps import BENCH_OWN_SETTINGS as _BENCH_OWN
    from dlstore.dataset import fetch_settings
    from dlstore.train.config import config_from_args

    for given, expected in (("12", 12), ("0", 0)):
        flags = ["--fetch-node-connections", given]
        train = config_from_args(build_parser().parse_args(["train", "file:///d/train", *flags]), env={})
        bench = build_parser().parse_args(["bench", "file:///d/train", *flags])
        data = BenchConfig(DataConfig.from_args(bench.url, bench, env={}, exclude=_BENCH_OWN)).data
        for cfg in (train.data, data):
            assert CacheConfig("/tmp/cache", "1GB", **fetch_settings(cfg)).node_connections == expected
        assert DataConfig.from_dict(train.data.to_dict()) == train.data
    assert CacheConfig("/tmp/cache", "1GB", **fetch_settings(DataConfig("file:///d/train"))).node_connections == 64
    with pytest.raises(ConfigError):
        DataConfig("file:///d/train", fetch_node_connections=-1)
    with pytest.raises(ConfigError):
        CacheConfig("/tmp/cache", "1GB", node_connections=-1)


def test_writable_dir_makes_the_folder_or_names_it_and_the_flag(tmp_path):
    made = tmp_path / "a" / "b"
    assert writable_dir(str(made), "--output-dir") == str(made) and made.is_dir()
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"cannot use .*a-file/run \(--output-dir\): Not a directory"):
        writable_dir(str(tmp_path / "a-file" / "run"), "--output-dir")
    with pytest.raises(ConfigError, match=r"cannot use /proc/dlstore-run \(--tmp-dir\)"):
        writable_dir("/proc/dlstore-run", "--tmp-dir")


@pytest.mark.parametrize("size", [0, -5, "abc", 2.5, True])
def test_a_bad_image_size_says_what_is_wrong_with_it(size):
    """`image_size=0` said "image_size=0 disagrees with the transform's image_size=224" (0 was
    taken as not given), and `"abc"` raised a bare TypeError from a comparison."""
    for make in (lambda: DataConfig("file:///d", image_size=size), lambda: TransformConfig(image_size=size)):
        with pytest.raises(ConfigError, match=f"image_size must be a positive whole number of pixels, not {size!r}"):
            make()
