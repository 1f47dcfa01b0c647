//! Real Firecracker, from the shared build (`../shared/firecracker`): [`vmm`] drives one
//! process (its API, its serial console, kill on drop).

pub mod vmm;
