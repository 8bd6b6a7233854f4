"""One libtorrent session per process: seeds published versions, fetches new ones, counts bytes.

Settings come from measurements on loopback swarms (docs/BENCHMARKS.md): DHT, LSD,
UPnP and NAT-PMP off (private swarms, the learner is the tracker); uTP off (5-8x slower on loopback);
several connections per IP allowed (every local peer shares 127.0.0.1); a short request queue at the
seed and no strict end-game so leechers trade pieces instead of all pulling from the learner.
Torrents are not auto-managed, so the session never queues or pauses one behind our back.

`fetch` never trusts a download: `poll` marks a version complete only after libtorrent has verified
every piece (its SHA-1 in the v1 torrent) and the caller re-checks the whole file's digest.

A node may be used from two threads (the learner announces versions from a background thread): each public
method holds the node's lock while it reads or changes its table of transfers.
"""

from __future__ import annotations

import functools
import shutil
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from echo2cli.broadcast.tracker import ANNOUNCE_INTERVAL_S
from echo2cli.errors import BroadcastError, is_disk_full


@dataclass
class Transfer:
    key: Hashable  # the caller's name for the torrent (echo2 uses layout.VersionKey)
    handle: Any  # libtorrent.torrent_handle
    save_path: Path
    started: float = field(default_factory=time.time)
    finished_at: float | None = None
    hash_failures: int = 0
    error: str = ""
    priorities: list[int] | None = None  # slot gating, see `slot_priorities`; None once everything is open
    share: list[int] | None = None  # the pieces of this fetcher's own slot, if it has one
    needs_learner: bool = True  # False once its share is complete, until the download stalls (`TorrentNode.poll`)
    pieces_done: int = 0
    last_progress: float = field(default_factory=time.time)
    tracker_urls: list[str] = field(default_factory=list)  # as in the torrent, before our key is added
    web_seed_url: str = ""  # the learner's web seed, once added (`TorrentNode._fall_back`)
    web_seed_at: float | None = None
    reannounced: int = 0  # how many of REANNOUNCE_AT_S are done
    flush_asked_at: float | None = None  # when, seeding, we asked libtorrent to write out its buffers
    flushed: bool = False  # libtorrent said it has (cache_flushed_alert)
    received: int = 0  # payload bytes, as of `last_received`
    last_received: float = field(default_factory=time.time)

    def written(self, now: float) -> bool:
        """Seeding, and every block on disk. libtorrent verifies a piece from its store buffer and can report the
        torrent seeding before its disk thread has written the last blocks: a small delta's file was read then
        before it existed (FileNotFoundError in the worker's rebuild). So once seeding, ask it to flush its buffers
        and wait for its word (cache_flushed_alert); should that not come within FLUSH_WAIT_S, files on disk at
        their full sizes do."""
        if not self.handle.status().is_seeding:
            return False
        if self.flush_asked_at is None:
            self.handle.flush_cache()
            self.flush_asked_at = now
            return False
        if self.flushed:
            return True
        return now - self.flush_asked_at > FLUSH_WAIT_S and files_on_disk(
            self.save_path, self.handle.torrent_file().files()
        )

    def stalled_for(self, now: float) -> float:
        """Seconds since the last block's worth of payload arrived (from anyone). A throttled connection still
        trickles a byte now and then (`SPARED`): that is not progress."""
        received = int(self.handle.status().total_payload_download)
        if received - self.received >= BLOCK:
            self.received, self.last_received = received, now
        return now - self.last_received

    def open_gates(self) -> None:
        """Let pieces that another worker already holds be fetched (from anyone)."""
        prios = self.priorities
        if prios is None or self.finished_at is not None:
            return
        status = self.handle.status()
        now = time.time()
        if status.num_pieces != self.pieces_done:
            self.pieces_done, self.last_progress = status.num_pieces, now
        have = status.pieces
        idle = all(have[i] for i, p in enumerate(prios) if p > 0) or now - self.last_progress > GATE_STALL_S
        changed = False
        for i, count in enumerate(self.handle.piece_availability()):
            if prios[i] == 0 and (idle or count >= 2):
                prios[i], changed = 4, True
        if changed:
            self.handle.prioritize_pieces(prios)
        if 0 not in prios:
            self.priorities = None


def files_on_disk(save_path: Path, files: Any) -> bool:
    """`files`: a libtorrent file_storage (its `num_files`, `file_path` and `file_size`)."""
    for i in range(files.num_files()):
        try:
            if (save_path / files.file_path(i)).stat().st_size < files.file_size(i):
                return False
        except FileNotFoundError:
            return False
    return True


GATE_STALL_S = 3.0
FLUSH_WAIT_S = 2.0
BLOCK = 16 << 10  # BitTorrent's request size
SPARED = 1  # bytes/s a worker takes from the learner while it spares it (0 would mean "no limit")
# A download announces again this many seconds after it started, to learn of peers that announced after it: a
# private torrent has no PEX, and a peer behind NAT is never dialled, so it must dial everyone it can itself.
REANNOUNCE_AT_S = (1.0, 2.5, 5.0)
WEB_SEED_AFTER_S = 8.0  # a download without a byte for this long also asks the learner's web seed


def slot_priorities(num_pieces: int, k: int, n: int, width: int = 1) -> list[int]:
    """Initial piece priorities for the fetcher with shares k .. k + width - 1 of n: its own contiguous width/n of the
    pieces only. The learner sizes shares by each worker's uplink (`Fleet.hand`), so a fast uplink, which can pass
    its pieces on sooner, holds more of the first copy.

    While a version is new, only the learner has it. Each worker first asks for its own share, so the
    learner's uplink carries each piece about once. Any other piece stays at priority 0 (not wanted)
    until `Transfer.open_gates` sees a second holder besides the learner (availability ≥ 2): otherwise
    rarest-first would ask the learner for exactly the pieces no worker has yet, and the learner would
    send them twice. The workers trade shares among themselves as pieces are verified (pipelined).
    Once its share is complete, or nothing arrived for GATE_STALL_S (a share's owner left), a worker
    opens every piece, so no gate can stall a download.
    """
    if not (0 <= k and width >= 1 and k + width <= n):
        raise ValueError(f"slot {k} (width {width}) of {n}")
    return [7 if k <= i * n // num_pieces < k + width else 0 for i in range(num_pieces)]


F = TypeVar("F", bound=Callable[..., Any])


def _locked(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: TorrentNode, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class TorrentNode:
    def __init__(
        self,
        listen: str = "0.0.0.0:0",
        *,
        upload_limit_bytes_s: int = 0,
        download_limit_bytes_s: int = 0,
        tracker_key: str = "",
        web_seed: str = "",
        web_seed_mode: str = "fallback",
        learner_ip: str = "",
    ) -> None:
        """`tracker_key`: announce to `<the torrent's tracker URL>/<key>` (echo2's tracker wants it).
        `web_seed`: the learner's URL; its web seed (broadcast/webseed.py) is `<url>/webseed/<key>/`. A fetch adds
        it when nothing arrived for WEB_SEED_AFTER_S (`web_seed_mode="fallback"`), from the start ("always"), or
        never ("off"). `learner_ip`: the learner's address, for `_spare_learner`."""
        import libtorrent as lt

        if web_seed_mode not in ("fallback", "always", "off"):
            raise ValueError(f"web seed mode {web_seed_mode!r}: fallback, always or off")
        self._lt = lt
        self._lock = threading.RLock()
        self.tracker_key = tracker_key
        self.web_seed = web_seed.rstrip("/") if web_seed_mode != "off" else ""
        self.web_seed_mode = web_seed_mode
        settings = {
            "listen_interfaces": listen,
            "enable_dht": False,
            "enable_lsd": False,
            "enable_upnp": False,
            "enable_natpmp": False,
            "enable_incoming_utp": False,
            "enable_outgoing_utp": False,
            "allow_multiple_connections_per_ip": True,
            "alert_mask": int(lt.alert_category.status | lt.alert_category.error | lt.alert_category.storage),
            "max_allowed_in_request_queue": 16,
            "tick_interval": 100,
            "rate_limit_ip_overhead": False,
            "strict_end_game_mode": False,
            "close_redundant_connections": False,  # slot gates make interest come and go: stay connected
            "stop_tracker_timeout": 1,
            # libtorrent re-announces no more often than this (default 300 s) whatever the tracker asks, and
            # echo2's tracker forgets a peer 3 intervals after its last announce: a seed must re-announce within
            # that, or a worker that starts fetching a version late (a late joiner, a slow link) finds no peer.
            "min_announce_interval": ANNOUNCE_INTERVAL_S,
            "upload_rate_limit": upload_limit_bytes_s,
            "download_rate_limit": download_limit_bytes_s,
            "user_agent": "echo2",
        }
        self.session = lt.session(settings)  # type: ignore[call-overload]  # the bindings take a dict too
        self.learner_ip = learner_ip
        self._sparing = False
        self._learner_class = self._classify_peers(bool(upload_limit_bytes_s or download_limit_bytes_s))
        self.transfers: dict[Hashable, Transfer] = {}
        self._removed_upload = 0

    def _classify_peers(self, rate_limited: bool) -> int | None:
        """Peer classes by IP; returns the learner's class (None without `learner_ip`). Rate limits skip local peers
        unless every IP is put in the global class. A connection's classes are fixed when it opens, so the learner's
        class is set up now and only its limit changes later (`_spare_learner`)."""
        if not (rate_limited or self.learner_ip):
            return None
        lt = self._lt
        everyone = 1 << lt.session.global_peer_class_id
        flt = lt.ip_filter()
        flt.add_rule("0.0.0.0", "255.255.255.255", everyone)
        learner_class = None
        if self.learner_ip:
            learner_class = self.session.create_peer_class("learner")
            flt.add_rule(self.learner_ip, self.learner_ip, everyone | 1 << learner_class)
        self.session.set_peer_class_filter(flt)
        return learner_class

    @property
    def listen_port(self) -> int:
        return int(self.session.listen_port())

    def _add(
        self, key: Hashable, torrent: bytes, save_path: Path, seed: bool, slot: tuple[int, int, int] | None = None
    ) -> Transfer:
        lt = self._lt
        params = lt.add_torrent_params()
        params.ti = lt.torrent_info(torrent)
        params.save_path = str(save_path)
        params.flags &= ~lt.torrent_flags.auto_managed
        params.flags &= ~lt.torrent_flags.paused
        if seed:
            params.flags |= lt.torrent_flags.seed_mode  # we just hashed it: skip the recheck
        save_path.mkdir(parents=True, exist_ok=True)
        transfer = Transfer(key, self.session.add_torrent(params), save_path)
        transfer.tracker_urls = [url.rstrip("/") for url in lt.load_torrent_buffer(torrent).trackers]
        self._announce_with_key(transfer)
        if slot is not None and slot[1] > slot[2] and not seed:  # a fetcher that owns every share has no gate
            transfer.priorities = slot_priorities(params.ti.num_pieces(), *slot)
            transfer.share = [i for i, p in enumerate(transfer.priorities) if p > 0]
            transfer.handle.prioritize_pieces(transfer.priorities)
        if seed:
            transfer.finished_at = transfer.started
        elif self.web_seed_mode == "always":
            self._fall_back(transfer)
        self.transfers[key] = transfer
        return transfer

    def _fall_back(self, transfer: Transfer) -> None:
        """Ask the learner's web seed too (a URL with a trailing slash: libtorrent appends the torrent's paths)."""
        if self.web_seed and transfer.web_seed_at is None:
            transfer.web_seed_url = f"{self.web_seed}/webseed/{self.tracker_key or '-'}/"
            transfer.handle.add_url_seed(transfer.web_seed_url)
            transfer.web_seed_at = time.time()

    def _announce_with_key(self, transfer: Transfer) -> None:
        """The learner's tracker serves only joined peers: announce to `<url>/<our key>`."""
        if self.tracker_key and transfer.tracker_urls:
            entries = [self._lt.announce_entry(f"{u}/{self.tracker_key}") for u in transfer.tracker_urls]
            transfer.handle.replace_trackers(entries)

    @_locked
    def set_tracker_key(self, key: str) -> None:
        """A worker that joined again (the learner restarted) announces every transfer with its new key."""
        self.tracker_key = key
        for transfer in self.transfers.values():
            self._announce_with_key(transfer)
            transfer.handle.force_reannounce()
            if transfer.web_seed_at is not None:  # the old key is refused now: ask with the new one
                transfer.handle.remove_url_seed(transfer.web_seed_url)
                transfer.web_seed_at = None
                self._fall_back(transfer)

    @_locked
    def seed(self, key: Hashable, torrent: bytes, save_path: Path) -> Transfer:
        return self._add(key, torrent, save_path, seed=True)

    @_locked
    def fetch(
        self, key: Hashable, torrent: bytes, save_path: Path, slot: tuple[int, int, int] | None = None
    ) -> Transfer:
        """Start downloading; `slot=(k, n, width)` asks for piece ranges k .. k + width - 1 of n first (see below)."""
        if key in self.transfers:
            return self.transfers[key]
        return self._add(key, torrent, save_path, seed=False, slot=slot)

    @_locked
    def poll(self) -> None:
        """Drain alerts (hash failures, errors), mark complete downloads, open slot gates.

        Complete means every piece verified (`is_seeding`), not libtorrent's "finished", which only
        means every *wanted* piece and fires early while slot gates hold pieces back; and every file written
        (`Transfer.written`).
        """
        lt = self._lt
        by_handle = {t.handle: t for t in self.transfers.values()}
        for alert in self.session.pop_alerts():
            transfer = by_handle.get(getattr(alert, "handle", None))
            if transfer is None:
                continue
            if isinstance(alert, lt.hash_failed_alert):
                transfer.hash_failures += 1
            elif isinstance(alert, (lt.torrent_error_alert, lt.file_error_alert)):
                transfer.error = alert.message()
            elif isinstance(alert, lt.cache_flushed_alert):
                transfer.flushed = True
        now = time.time()
        for transfer in self.transfers.values():
            if transfer.finished_at is None and transfer.written(now):
                transfer.finished_at = now
            transfer.open_gates()
            if transfer.finished_at is None:
                if (
                    transfer.reannounced < len(REANNOUNCE_AT_S)
                    and now - transfer.started > REANNOUNCE_AT_S[transfer.reannounced]
                ):
                    transfer.handle.force_reannounce(0, -1, lt.reannounce_flags_t.ignore_min_interval)
                    transfer.reannounced += 1
                if transfer.stalled_for(now) > WEB_SEED_AFTER_S:
                    self._fall_back(transfer)
        self._spare_learner(now)

    def _spare_learner(self, now: float) -> None:
        """Take nothing more from the learner while every download in progress has its own share and is moving.

        Once a worker holds its own slot's pieces, whatever else it asks the learner for is a second copy of a
        piece another worker holds or will hold: the learner's duplicate uploads that kept its upload at 1.4-1.9x
        the version on equal links at N = 8. So the learner's connection is throttled to nothing (its peer class)
        and the rest comes from the other workers. A download that stalls for GATE_STALL_S (a share's owner is
        slow or gone) takes from the learner again until it completes. Where every peer has the learner's address
        (all on one host, as in `echo2 demo`) the learner cannot be told apart, and is never spared.
        """
        if self._learner_class is None:
            return
        spare = False
        for transfer in self.transfers.values():
            if transfer.finished_at is not None:
                continue
            if transfer.needs_learner and transfer.share is not None and transfer.stalled_for(now) < GATE_STALL_S:
                have = transfer.handle.status().pieces
                others = any(p.ip[0] != self.learner_ip for p in transfer.handle.get_peer_info())
                transfer.needs_learner = not (others and all(have[i] for i in transfer.share))
            elif not transfer.needs_learner and transfer.stalled_for(now) > GATE_STALL_S:
                transfer.needs_learner, transfer.share = True, None  # for good: this download needs every source
            if transfer.needs_learner:
                spare = False
                break
            spare = True
        if spare != self._sparing:
            info = self.session.get_peer_class(self._learner_class)
            info["download_limit"] = SPARED if spare else 0
            self.session.set_peer_class(self._learner_class, info)
            self._sparing = spare

    @_locked
    def seeding(self, key: Hashable) -> bool:
        """True if this node holds the whole of `key`'s torrent and serves it."""
        transfer = self.transfers.get(key)
        return transfer is not None and transfer.finished_at is not None

    @_locked
    def progress(self, key: Hashable) -> float:
        transfer = self.transfers.get(key)
        return float(transfer.handle.status().progress) if transfer else 0.0

    @_locked
    def check(self, key: Hashable) -> None:
        """Raise what went wrong with a transfer (a full disk, a storage error), if anything did."""
        transfer = self.transfers[key]
        if transfer.error:
            if is_disk_full(transfer.error):
                raise BroadcastError(f"disk full while fetching {key} into {transfer.save_path}")
            raise BroadcastError(f"torrent for {key} failed: {transfer.error}")

    @_locked
    def recheck(self, key: Hashable) -> None:
        """Hash the local file again (it changed on disk since libtorrent verified it); not complete until done."""
        transfer = self.transfers[key]
        transfer.handle.force_recheck()
        transfer.finished_at = None

    @_locked
    def upload_bytes(self, key: Hashable | None = None) -> int:
        """Bytes uploaded to peers: for one torrent, or in total (removed torrents included)."""
        if key is not None:
            transfer = self.transfers.get(key)
            return int(transfer.handle.status().all_time_upload) if transfer else 0
        live = sum(int(t.handle.status().all_time_upload) for t in self.transfers.values())
        return live + self._removed_upload

    @_locked
    def download_bytes(self, key: Hashable) -> int:
        """Bytes received for a torrent: libtorrent's payload counter, or the verified bytes held if more. The
        counter is brought up to date once a second, so right after a fast transfer it can read low (0 for a
        one-piece delta); a fetch always starts in an empty directory, so every verified byte came over the wire."""
        transfer = self.transfers.get(key)
        if transfer is None:
            return 0
        status = transfer.handle.status()
        return int(max(status.all_time_download, status.total_done))

    @_locked
    def remove(self, key: Hashable, delete_dir: Path | None = None) -> None:
        transfer = self.transfers.pop(key, None)
        if transfer is not None:
            self._removed_upload += int(transfer.handle.status().all_time_upload)
            self.session.remove_torrent(transfer.handle)
        if delete_dir is not None:
            shutil.rmtree(delete_dir, ignore_errors=True)

    @_locked
    def close(self) -> None:
        for key in list(self.transfers):
            self.remove(key)
        self.session.pause()
