"""Redis URLs (routing.redis_connect): what each names, what is refused, and the
client each gets; the gateway's config and the nodes' flags refuse what names nothing."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gateway.front.config import GatewayConfig
from routing.redis_connect import RedisUrlError, connect, hash_tag, parse_redis_url


def test_urls_name_a_server_a_sentinel_primary_or_a_cluster() -> None:
    t = parse_redis_url("rediss://user:p%40ss@redis.internal:6380/2")
    assert (t.shape, t.hosts, t.tls, t.db, t.username, t.password) == (
        "standalone",
        (("redis.internal", 6380),),
        True,
        2,
        "user",
        "p@ss",
    )
    assert "p@ss" not in repr(t)
    t = parse_redis_url("redis+sentinel://s1,s2:26380,[::1]/mymaster/1")
    assert t.shape == "sentinel" and t.service == "mymaster" and t.db == 1
    assert t.hosts == (("s1", 26379), ("s2", 26380), ("::1", 26379))
    t = parse_redis_url("redis+cluster://a:7000,b:7001")
    assert t.shape == "cluster" and t.hosts == (("a", 7000), ("b", 7001))


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://a:1", "starts with"),
        ("redis+sharded://a:1", "starts with"),
        ("redis+sentinel://a:26379", "service"),
        ("redis://a:1,b:2/0", "cluster"),
        ("redis+cluster://a:7000/1", "database 0"),
        ("redis://a:x/0", "port"),
    ],
)
def test_urls_that_name_nothing_are_refused(url: str, says: str) -> None:
    with pytest.raises(RedisUrlError, match=says):
        parse_redis_url(url)
    with pytest.raises(ValueError, match=says):
        GatewayConfig(redis_url=url)


def test_each_shape_gets_redis_pys_own_client() -> None:
    assert isinstance(connect("redis://127.0.0.1:1/0"), Redis)
    sentinel = connect("redis+sentinel://127.0.0.1:1/mymaster", max_connections=5)
    assert isinstance(sentinel, Redis)
    assert type(sentinel.connection_pool).__name__ == "_SentinelBlockingPool"
    assert sentinel.connection_pool.max_connections == 5
    assert isinstance(connect("redis+cluster://127.0.0.1:1"), RedisCluster)
    cfg = GatewayConfig(redis_url="redis+cluster://127.0.0.1:1,127.0.0.1:2")
    assert isinstance(cfg.redis_client(), RedisCluster)


def test_hash_tags_hold_any_id() -> None:
    assert hash_tag("edge-eu-1") == "{edge-eu-1}"
    assert hash_tag("{x}") == "{%7Bx%7D}" != hash_tag("%7Bx%7D")


def test_node_flags_refuse_a_url_that_names_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from gateway.commands.node_args import add_node_arguments, check_redis_args

    parser = argparse.ArgumentParser()
    add_node_arguments(parser, 8001)
    args = parser.parse_args(["--redis", "redis://a:7000,b:7001"])
    with pytest.raises(SystemExit):
        check_redis_args(args, "edgecloud edge serve")
    assert "redis+cluster://" in capsys.readouterr().err
    ok = parser.parse_args(["--redis", "redis+cluster://a:7000,b:7001"])
    check_redis_args(ok, "edgecloud edge serve")
