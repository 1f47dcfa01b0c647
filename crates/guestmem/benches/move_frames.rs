//! The frames step of a move's pause: Firecracker's Diff file of a VM that wrote 64 MiB
//! spread over a 512 MiB region (runs of 16 pages every 512 KiB, as the lab's guest writes)
//! made into the chain's manifest with its pieces named later (what a move does), or cut
//! into the store's frames, hashed, held for the source's page server (a chain too deep).
//!
//! Then one of those frames fetched from the source's page server over loopback, held and
//! named later (read and hashed when asked).
//!
//! `cargo bench -p guestmem --features store --bench move_frames`. The diff lies in
//! /dev/shm (where the move writes it); the base is a store snapshot of zeros.

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use guestmem::store::{
    name_later, push, push_held, read_snapshot, Client, FetchPolicy, Frames, HeldFrames,
    PeerServer, PushConfig, PushSource, Snapshot, StoreUrl,
};

const REGION: u64 = 512 << 20;
const DIRTY: u64 = 64 << 20;
const RUN: u64 = 64 << 10;

fn bench(c: &mut Criterion) {
    let dir = std::path::PathBuf::from("/dev/shm");
    let base_file = dir.join(format!("gm-bench-base-{}", std::process::id()));
    let diff_file = dir.join(format!("gm-bench-diff-{}", std::process::id()));
    let f = std::fs::File::create(&base_file).unwrap();
    f.set_len(REGION).unwrap();
    let f = std::fs::File::create(&diff_file).unwrap();
    f.set_len(REGION).unwrap();
    let stride = REGION / (DIRTY / RUN);
    let run: Vec<u8> = (0..RUN).map(|i| (i * 7 + 1) as u8).collect();
    for at in (0..REGION).step_by(stride as usize) {
        f.write_all_at(&run, at).unwrap();
    }
    drop(f);
    let store = Arc::new(Client::in_memory("store").unwrap());
    let base = StoreUrl::parse("s3://bench/base", false).unwrap();
    push(
        &store,
        &PushSource::Raw(base_file.clone()),
        &base,
        &PushConfig::default(),
    )
    .unwrap();
    let _ = std::fs::remove_file(&base_file);
    let snap = Arc::new(
        read_snapshot(
            &Frames::new(Arc::clone(&store), None, FetchPolicy::default()),
            &base,
        )
        .unwrap(),
    );
    let diff = StoreUrl::parse("s3://bench/diff", false).unwrap();
    let mut g = c.benchmark_group("move-frames-64MiB-of-512MiB");
    g.sample_size(20).measurement_time(Duration::from_secs(10));
    let cfg = |threads| PushConfig {
        frame_bytes: snap.frame_bytes(),
        threads,
        compress: false,
        base_from: Some(Arc::clone(&store)),
        base: Some(Arc::clone(&snap)),
        look_first: false,
        reused_file_ok: false,
        stop: None,
    };
    let src = PushSource::RawDiff {
        path: diff_file.clone(),
        base: base.clone(),
    };
    // The chain's manifest from the diff's shape, its pieces named later (what a move does).
    g.bench_function("named-later", |b| {
        b.iter_batched(
            HeldFrames::new,
            |frames| {
                name_later(&diff_file, &snap, &diff, &frames)
                    .unwrap()
                    .unwrap();
                frames
            },
            BatchSize::PerIteration,
        )
    });
    for threads in [1, 2] {
        // The frames held where they lie in the file (what a move does).
        g.bench_function(format!("held-{threads}-threads"), |b| {
            b.iter_batched(
                || {
                    (
                        Arc::new(Client::in_memory("held").unwrap()),
                        HeldFrames::new(),
                    )
                },
                |(held, frames)| {
                    push_held(&held, &src, &diff, &cfg(threads), &frames).unwrap();
                    (held, frames)
                },
                BatchSize::PerIteration,
            )
        });
        // Each frame's object made in memory (before: 64 MiB of fresh pages in the pause).
        g.bench_function(format!("in-memory-{threads}-threads"), |b| {
            b.iter_batched(
                || Arc::new(Client::in_memory("held").unwrap()),
                |held| {
                    push(&held, &src, &diff, &cfg(threads)).unwrap();
                    held
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();

    // A frame of the diff fetched from the source's page server, as a destination's fault
    // fetches it (loopback, no added round trip): the part of a remote fault this side owns.
    let held = Arc::new(Client::in_memory("held").unwrap());
    let frames = Arc::new(HeldFrames::new());
    push_held(&held, &src, &diff, &cfg(2), &frames).unwrap();
    let chain = Snapshot::parse(
        &diff,
        &held.get("snapshots/diff/manifest.json").unwrap().unwrap(),
    )
    .unwrap();
    let key = piece_key(&chain);
    let (server, peer) = serve(&frames, &held);
    let mut g = c.benchmark_group("move-peer-get");
    g.sample_size(50).measurement_time(Duration::from_secs(5));
    g.bench_function("a-64KiB-piece-over-loopback", |b| {
        b.iter(|| peer.get(&key).unwrap().expect("held"))
    });
    // The same piece named later: read and hashed when asked.
    let later = Arc::new(HeldFrames::new());
    let named = name_later(&diff_file, &snap, &diff, &later)
        .unwrap()
        .unwrap();
    let chain = Snapshot::parse(&diff, &named.manifest).unwrap();
    let key_later = piece_key(&chain);
    let (server_later, peer_later) = serve(&later, &held);
    g.bench_function("a-64KiB-piece-named-later-over-loopback", |b| {
        b.iter(|| peer_later.get(&key_later).unwrap().expect("held"))
    });
    g.finish();
    drop(server);
    drop(server_later);
    let _ = std::fs::remove_file(&diff_file);
}

/// The key of the first piece of the diff's pages in `chain`.
fn piece_key(chain: &Snapshot) -> String {
    let piece = chain
        .manifest
        .frames
        .iter()
        .find_map(|stack| stack.iter().find(|p| p.p.is_some()))
        .expect("a frame with the diff's pages");
    format!("frames/{}", piece.h)
}

/// `frames` served by a source's page server on loopback, and a client of it.
fn serve(frames: &Arc<HeldFrames>, held: &Arc<Client>) -> (PeerServer, Client) {
    let server = PeerServer::start(
        "127.0.0.1:0".parse().unwrap(),
        Arc::clone(frames),
        Arc::clone(held),
    )
    .unwrap();
    let peer = Client::peer(&format!("http://{}", server.addr())).unwrap();
    (server, peer)
}

criterion_group!(benches, bench);
criterion_main!(benches);
