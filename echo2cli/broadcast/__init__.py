"""Weight broadcast: each policy version is a private BitTorrent swarm seeded by the learner.

`torrent` makes and reads .torrent files, `node` wraps a libtorrent session (seed, fetch, progress,
upload accounting), `tracker` is the pure announce logic the learner serves at `/announce`.
"""
