"""Faults a rank brings about on its own test host (tests/cluster: a host's
processes run as root in its namespaces), and the same commands for the
cluster to run in a host. One copy for the fault workers and tests/cluster.
"""

import subprocess

# Every packet on the host's link dropped, silently (no error anywhere).
NFT_DROP = """\
table inet kdt_drop {
    chain in { type filter hook input priority -300; iifname "eth0" drop; }
    chain out { type filter hook output priority -300; oifname "eth0" drop; }
}
"""
LINK_DOWN = ["ip", "link", "set", "eth0", "down"]


def drop_this_hosts_packets():
    subprocess.run(["nft", "-f", "-"], input=NFT_DROP.encode(), check=True)


def take_this_hosts_link_down():
    subprocess.run(LINK_DOWN, check=True)
