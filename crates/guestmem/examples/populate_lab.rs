//! A quick, interleaved comparison of populate variants on one anonymous THP region.
//!
//! `cargo run --release -p guestmem --example populate_lab -- [GiB] [rounds]`
//!
//! Each round maps a fresh region per variant (A B C ... A B C ...), brings it up without
//! verification, and records the populate phase; the first round is a warm-up and is dropped.
//! The lab proper (CLI) is someone else's; this is the library author's sanity check.

use guestmem::{
    bringup, BringupConfig, GuestAddress, GuestMap, Method, PinStrategy, PopulateConfig,
    RegionSpec, Verify,
};

fn main() {
    let mut args = std::env::args().skip(1);
    let gib: u64 = args.next().map_or(2, |a| a.parse().expect("GiB"));
    let rounds: usize = args.next().map_or(7, |a| a.parse().expect("rounds"));
    let variants = [
        (
            "1 thread  populate-write up-front",
            1,
            Method::PopulateWrite,
            PinStrategy::UpFront,
        ),
        (
            "2 threads populate-write up-front",
            2,
            Method::PopulateWrite,
            PinStrategy::UpFront,
        ),
        (
            "2 threads populate-write per-chunk",
            2,
            Method::PopulateWrite,
            PinStrategy::PerChunk,
        ),
        (
            "2 threads populate-write no pin",
            2,
            Method::PopulateWrite,
            PinStrategy::None,
        ),
        (
            "2 threads touch no pin",
            2,
            Method::Touch,
            PinStrategy::None,
        ),
    ];
    let mut secs = vec![Vec::new(); variants.len()];
    for round in 0..=rounds {
        for (i, (_, threads, method, pin)) in variants.iter().enumerate() {
            let map =
                GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0), gib << 30)]).expect("map");
            let cfg = BringupConfig {
                populate: PopulateConfig {
                    threads: *threads,
                    method: *method,
                    pin: *pin,
                    ..PopulateConfig::default()
                },
                pin_policy: guestmem::PinPolicy::Required,
                verify: Verify::Off,
            };
            let r = bringup(&map.view(), &cfg).expect("bringup");
            if round > 0 {
                secs[i].push(r.seconds("lock") + r.seconds("populate"));
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let base = median(&mut secs[0].clone());
    for ((name, ..), v) in variants.iter().zip(&mut secs) {
        let m = median(v);
        println!(
            "{name:36} median {m:.3}s  min {:.3}s  max {:.3}s  {:.1} GB/s  x{:.2} vs 1 thread",
            v[0],
            v[v.len() - 1],
            (gib << 30) as f64 / m / 1e9,
            base / m
        );
    }
}
