//! Fuzzes `manifest.json` parsing and checking: any bytes must give a manifest within its
//! bounds or a clear error, never a panic.
#![no_main]

use guestmem::snapshot::{Manifest, MAX_BLOCKS, MAX_PAGE_BLOCK_BYTES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Manifest::from_json(data) {
        assert!(m.block_bytes.is_power_of_two() && m.block_bytes <= MAX_PAGE_BLOCK_BYTES);
        let total = m.total_blocks();
        assert!(total <= MAX_BLOCKS);
        assert!(m.blocks.iter().all(|b| b.index < total));
    }
});
