//! KVM's dirty log, harvested into the word-level bitmaps, holds exactly what was written.

mod common;

use std::collections::BTreeSet;

use guestmem::dirty::DirtyPages;
use guestmem::GuestAddress;
use guestmem_lab::vm::guest::{GuestMode, Range, Workload};

const VCPUS: usize = 4;
const SLOTS: usize = 64;
const BYTES: u64 = 128 << 20;

/// Sparse slices: in slot `s`, vCPU `v` writes a run of `1 + (s + v) % 5` pages starting at
/// page `(s * 37 + v * 101 + salt) % 100 + 100 v` (under the 512 pages of a slot), so runs differ per slot, vCPU and pass and some
/// straddle bitmap words.
fn sparse_slices(data: &[(u64, u64)], salt: u64) -> Vec<Vec<Range>> {
    (0..VCPUS as u64)
        .map(|v| {
            data.iter()
                .enumerate()
                .map(|(s, &(start, _))| {
                    let s = s as u64;
                    let first = (s * 37 + v * 101 + salt) % 100 + v * 100;
                    let len = 1 + (s + v) % 5;
                    (start + first * 4096, start + (first + len) * 4096)
                })
                .collect()
        })
        .collect()
}

/// Pages (as guest addresses) the slices cover.
fn pages_of(slices: &[Vec<Range>]) -> BTreeSet<u64> {
    slices
        .iter()
        .flatten()
        .flat_map(|&(a, b)| (a..b).step_by(4096))
        .collect()
}

/// Every dirty page in every slot's bitmap, as guest addresses; the bitmaps are emptied.
fn take_all(s: &common::Setup) -> BTreeSet<u64> {
    let mut words = Vec::new();
    let mut out = BTreeSet::new();
    for r in &s.data {
        let start = r.guest_addr().0;
        s.slots
            .bitmap(GuestAddress(start))
            .unwrap()
            .take(&mut words);
        out.extend(DirtyPages::new(&words).map(|p| start + p * 4096));
    }
    out
}

#[test]
fn harvest_after_each_pass_holds_exactly_the_pages_written() {
    if !common::kvm_usable() {
        return;
    }
    let mut s = common::setup(BYTES, SLOTS);
    let data: Vec<(u64, u64)> = s
        .data
        .iter()
        .map(|r| (r.guest_addr().0, r.guest_end()))
        .collect();
    assert_eq!(data.len(), SLOTS);

    let mut work = Workload::start_with_slices(
        &s.vm,
        &s.map,
        sparse_slices(&data, 0),
        GuestMode::Protected32,
    )
    .unwrap();
    for (pass, salt) in [(1u32, 0u64), (2, 13), (3, 200)] {
        let slices = sparse_slices(&data, salt);
        let want = pages_of(&slices);
        work.set_slices(&s.map, slices).unwrap();

        work.write_pass(pass).unwrap();
        let h = s.slots.harvest().unwrap();

        assert_eq!(h.slots, SLOTS + 1, "control slot logs too");
        assert_eq!(h.dirty_pages, want.len() as u64, "pass {pass}");
        let got = take_all(&s);
        assert_eq!(got, want, "pass {pass}");
        // Every slot was written in every pass.
        for &(a, b) in &data {
            assert!(got.range(a..b).next().is_some());
        }
    }
}

#[test]
fn host_marks_and_guest_writes_meet_in_one_bitmap() {
    if !common::kvm_usable() {
        return;
    }
    let mut s = common::setup(16 << 20, 4);
    let data: Vec<(u64, u64)> = s
        .data
        .iter()
        .map(|r| (r.guest_addr().0, r.guest_end()))
        .collect();
    let slices: Vec<Vec<Range>> = vec![vec![(data[0].0, data[0].0 + 3 * 4096)]];
    let work = Workload::start_with_slices(&s.vm, &s.map, slices, GuestMode::Long64).unwrap();
    work.write_pass(1).unwrap();
    // A device model writes guest memory and tells the registry.
    let host_addr = data[2].0 + 70 * 4096 + 4000;
    s.map
        .translator()
        .write_in_region(GuestAddress(host_addr), &[1; 200])
        .unwrap();
    s.slots.mark(GuestAddress(host_addr), 200).unwrap();

    s.slots.harvest().unwrap();

    let want: BTreeSet<u64> = [
        data[0].0,
        data[0].0 + 4096,
        data[0].0 + 2 * 4096,
        data[2].0 + 70 * 4096,
        data[2].0 + 71 * 4096,
    ]
    .into();
    assert_eq!(take_all(&s), want);
    // A range outside every slot is refused.
    assert!(s.slots.mark(GuestAddress(0x8000_0000), 1).is_err());
}
