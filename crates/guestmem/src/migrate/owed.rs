//! What a move's source owes the destination, and letting go of it: the chain's pieces
//! its base does not hold, the pushed manifest checked against the chain served, and a
//! destination whose source went without a word looking for that manifest in the store.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::MoveError;
use crate::store::{read_snapshot, Frames, Snapshot, StoreError, StoreUrl};

/// The frames of `chain` whose top piece its base does not hold (those the source owes),
/// in memory order; refuses a chain that is not a diff on `base`.
pub(super) fn owed(
    base: &Snapshot,
    chain: &Snapshot,
) -> Result<Vec<(u64, blake3::Hash)>, MoveError> {
    let bad = |reason: String| {
        MoveError::Store(StoreError::Manifest {
            url: chain.url.to_string(),
            reason,
        })
    };
    if chain.manifest.base.as_deref() != Some(base.url.name.as_str()) {
        return Err(bad(format!(
            "not a diff on {} (its base: {:?})",
            base.url, chain.manifest.base
        )));
    }
    if chain.memory_bytes() != base.memory_bytes() || chain.frame_bytes() != base.frame_bytes() {
        return Err(bad(format!(
            "memory {:#x} in frames of {:#x}, its base's {:#x} in {:#x}",
            chain.memory_bytes(),
            chain.frame_bytes(),
            base.memory_bytes(),
            base.frame_bytes()
        )));
    }
    let held: HashSet<[u8; 32]> = base
        .frames
        .iter()
        .flatten()
        .map(|p| *p.hash.as_bytes())
        .collect();
    let mut out = Vec::new();
    for (i, stack) in chain.frames.iter().enumerate() {
        for p in stack {
            if !held.contains(p.hash.as_bytes()) {
                out.push((i as u64, p.hash));
            }
        }
    }
    Ok(out)
}

/// Checks the store's `url` names exactly the frames of `chain`; where `chain` names pieces
/// by `placeholders` (named later), the store's manifest gives their names: the same shape,
/// and for each piece the source served already, the hash it was served as.
pub(super) fn released(
    frames: &Frames,
    url: &str,
    chain: &Snapshot,
    placeholders: &HashSet<[u8; 32]>,
) -> Result<(), MoveError> {
    let u = StoreUrl::parse(url, false)?;
    if u.bucket != chain.url.bucket {
        return Err(MoveError::Refused {
            side: "destination",
            reason: format!("{url} is not in the base's bucket {}", chain.url.bucket),
        });
    }
    let pushed = read_snapshot(frames, &u)?;
    let refused = |why: String| MoveError::Refused {
        side: "destination",
        reason: format!("{url} does not name the frames the source owed: {why}"),
    };
    let names = crate::store::later_names(&pushed, chain, placeholders).map_err(refused)?;
    frames.name_later_as(&names).map_err(refused)
}

/// How long a destination whose source went looks for the diff in the store.
pub(super) const STORE_LOOK_LIMIT: Duration = Duration::from_secs(600);

/// Looks for the move's diff at `name` in the store, more slowly each time (0.25 s to 5 s),
/// until it is there and names what `chain` does ([`released`]: true), the VM is no longer
/// served (`served` readable) or `limit` has passed (false, said in the log).
pub(super) fn look_in_store(
    frames: &Frames,
    name: &StoreUrl,
    chain: &Snapshot,
    placeholders: &HashSet<[u8; 32]>,
    served: std::os::fd::BorrowedFd<'_>,
    limit: Duration,
) -> bool {
    let t0 = Instant::now();
    let mut wait = Duration::from_millis(250);
    let mut said = String::new();
    loop {
        match released(frames, &name.to_string(), chain, placeholders) {
            Ok(()) => return true,
            Err(e) => {
                let e = e.to_string();
                // A diff not there yet is the usual answer: said once, as any other.
                if e != said {
                    tracing::warn!("move: the source went; looking for {name} in the store: {e}");
                    said = e;
                }
            }
        }
        if t0.elapsed() >= limit {
            tracing::error!(
                "move: {name} was not in the store within {limit:?} of the source going; faults on the frames it owed will fail at the fetch deadline"
            );
            return false;
        }
        // Waits on the VM's end, not a timer alone: a VM that ended stops the look.
        let mut fds = [crate::sys::PollFd::readable(served)];
        if crate::sys::poll(&mut fds, Some(wait)).map_or(true, |n| n > 0) {
            return false;
        }
        wait = (wait * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::{look_in_store, owed};
    use crate::store::held_tests::{base_in_store, diff_config, diff_on, diff_scratch, MEM, PAGE};
    use crate::store::{
        name_later, push, read_snapshot, FetchPolicy, Frames, HeldFrames, PushSource, Snapshot,
        StoreUrl,
    };

    /// A destination whose source went without a word after the commit looks for the diff
    /// in the store under the move's name, and finds it once the source has pushed it
    /// (its pieces named, so owed faults go to the store); one whose VM is no longer served
    /// stops looking at once.
    #[test]
    fn a_destination_whose_source_went_finds_the_diff_in_the_store() {
        let Some(scratch) = diff_scratch("look-in-store") else {
            return;
        };
        let base_bytes: Vec<u8> = (0..MEM).map(|i| (i / PAGE) as u8 ^ 0x6b).collect();
        let (store, base) = base_in_store(&scratch, &base_bytes);
        let diff_path = scratch.join("diff");
        diff_on(&base_bytes, &diff_path);
        let frames = Frames::new(Arc::clone(&store), None, FetchPolicy::default());
        let snap = read_snapshot(&frames, &base).unwrap();
        let name = StoreUrl::parse("s3://bkt/moved", false).unwrap();
        let named = name_later(&diff_path, &snap, &name, &Arc::new(HeldFrames::new()))
            .unwrap()
            .unwrap();
        let chain = Snapshot::parse(&name, &named.manifest).unwrap();
        let owed: Vec<_> = owed(&snap, &chain)
            .unwrap()
            .into_iter()
            .map(|(_, h)| h)
            .collect();
        let placeholders = owed.iter().map(|h| *h.as_bytes()).collect();
        frames.name_later(owed.iter().copied());
        // (The store stands in for the source, which owes the placeholders.)
        frames.follow(Arc::clone(&store), owed.iter().copied());
        assert!(owed.iter().all(|h| frames.owed_here(h)));
        let served = crate::sys::eventfd().unwrap();

        // The source pushes the diff a while after it went.
        let pusher = {
            let (store, path, base, cfg) = (
                Arc::clone(&store),
                diff_path.clone(),
                base.clone(),
                diff_config(&store, snap.clone()),
            );
            let name = name.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(600));
                push(&store, &PushSource::RawDiff { path, base }, &name, &cfg).unwrap();
            })
        };
        use std::os::fd::AsFd;
        assert!(look_in_store(
            &frames,
            &name,
            &chain,
            &placeholders,
            served.as_fd(),
            Duration::from_secs(60)
        ));
        pusher.join().unwrap();
        assert!(
            owed.iter().all(|h| !frames.owed_here(h)),
            "a piece still waits for its name"
        );

        // The VM no longer served: the look ends at once, though nothing is there.
        let gone = StoreUrl::parse("s3://bkt/never", false).unwrap();
        crate::sys::eventfd_signal(served.as_fd()).unwrap();
        let t0 = Instant::now();
        assert!(!look_in_store(
            &frames,
            &gone,
            &chain,
            &placeholders,
            served.as_fd(),
            Duration::from_secs(60)
        ));
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
}
