"""Separate hosts on one Linux machine (root): namespaces joined by veth links (netns.py), and a
deployment file started across them with the public launcher (deployment.py). Used by
tests/hosts and meant for the multi-host benchmark."""
