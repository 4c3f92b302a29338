"""Separate hosts on one Linux machine (root): namespaces joined by veth links (netns.py), and a
deployment file started across them with the public launcher (deployment.py). Used by
tests/hosts and benchmarks/hosts.py; a test rig, so it lives outside the sglang_disagg package."""
