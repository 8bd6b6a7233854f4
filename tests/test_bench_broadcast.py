"""`echo2 bench broadcast`'s pure parts: the --links file and the refusals that need no network."""

import pytest

from echo2cli.bench.broadcast import lower_bound_s, parse_links, run_bench
from echo2cli.bench.netem import Link
from echo2cli.errors import ConfigError


def test_links_file_one_worker_per_line_with_comments():
    text = "# a mix\n10 10\n1000 500 nat  # a fast one behind NAT\n\n50 50 firewall\n"
    assert parse_links(text) == [Link(10, 10), Link(1000, 500, behind="nat"), Link(50, 50, behind="firewall")]


@pytest.mark.parametrize("bad", ["10", "10 10 10 10", "ten 10", "0 10", "10 -1", "10 10 upnp", "# nothing\n"])
def test_a_bad_links_file_names_the_line_and_the_format(bad):
    with pytest.raises(ConfigError, match="UP_MBPS DOWN_MBPS"):
        parse_links(bad, "links.txt")


def test_lower_bound_of_a_mix_is_set_by_its_slowest_downlink_or_the_total_upload():
    mb = 1e6 / 8  # bytes/s in one Mbit/s
    # 100 MB to 10 and 1000 Mbit/s workers: the 10 Mbit/s downlink takes 80 s.
    assert lower_bound_s(100e6, 2, 100 * mb, [10 * mb, 1000 * mb], [10 * mb, 1000 * mb]) == pytest.approx(80)
    # Equal 100 Mbit/s links: the learner's uplink, 8 s.
    assert lower_bound_s(100e6, 4, 100 * mb, [100 * mb] * 4, [100 * mb] * 4) == pytest.approx(8)


def test_nat_needs_namespaces_and_more_workers_than_the_file_lists_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="namespaces and iptables"):
        run_bench([1], up_mbps=100, links=[Link(100, 100, behind="nat")], mode="loopback", size_mb=1)
    with pytest.raises(ConfigError, match="--links lists 1"):
        run_bench([2], up_mbps=100, links=[Link(100, 100)], mode="loopback", size_mb=1)


def test_methods_are_star_swarm_and_swarm_equal():
    from echo2cli.bench.broadcast import run_bench_config
    from echo2cli.config import BenchBroadcastConfig

    with pytest.raises(ConfigError, match="swarm-equal"):
        run_bench_config(BenchBroadcastConfig(method="swarm,tree"))
