//! A server's status as Prometheus metrics, through prometheus-client: a collector that
//! reads the status at each scrape. Series per socket and fault class only (bounded by the
//! operator's configuration, never by the number of VMs).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use super::status::{ServerStatus, StatusHandle};
use crate::restore::FaultClass;

/// The status at one scrape.
#[derive(Debug)]
struct Scrape(ServerStatus);

type Labels = Vec<(&'static str, String)>;

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        let gauge = |enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: i64| {
            let m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
            ConstGauge::new(v).encode(m)
        };
        gauge(
            &mut enc,
            "guestmem_fleet_vms",
            "VMs served now",
            s.sessions.len() as i64,
        )?;
        gauge(
            &mut enc,
            "guestmem_fleet_draining",
            "1 while draining",
            i64::from(s.draining),
        )?;
        let counter = |enc: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64| {
            let m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(v).encode(m)
        };
        counter(
            &mut enc,
            "guestmem_fleet_refused",
            "VMs refused or ended",
            s.refused,
        )?;
        counter(
            &mut enc,
            "guestmem_fleet_dropped",
            "connections that were not a VM's",
            s.dropped,
        )?;
        let per_socket = |enc: &mut DescriptorEncoder<'_>,
                          name: &str,
                          help: &str,
                          v: fn(&super::status::SocketStatus) -> u64| {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for k in &s.sockets {
                let labels: Labels = vec![("socket", k.socket.to_string())];
                ConstCounter::new(v(k)).encode(m.encode_family(&labels)?)?;
            }
            Ok::<(), std::fmt::Error>(())
        };
        per_socket(
            &mut enc,
            "guestmem_vms_admitted",
            "VMs admitted on a socket since the start",
            |k| k.sessions,
        )?;
        let mut m = enc.encode_descriptor(
            "guestmem_vms_ended",
            "VMs whose session ended on a socket since the start, by how",
            None,
            MetricType::Counter,
        )?;
        for k in &s.sockets {
            let e = &k.ended;
            for (end, n) in [
                ("peer-closed", e.peer_closed),
                ("peer-exited", e.peer_exited),
                ("graduated", e.graduated),
                ("handed-off", e.handed_off),
                ("failed", e.failed),
            ] {
                let labels: Labels = vec![("socket", k.socket.to_string()), ("end", end.into())];
                ConstCounter::new(n).encode(m.encode_family(&labels)?)?;
            }
        }
        per_socket(
            &mut enc,
            "guestmem_bytes_copied",
            "bytes installed into VMs' memory",
            |k| k.bytes_copied,
        )?;
        let mut m = enc.encode_descriptor(
            "guestmem_fault_latency_seconds",
            "time from reading a fault to its install, by class",
            None,
            MetricType::Histogram,
        )?;
        for k in &s.sockets {
            for class in FaultClass::ALL {
                let l = k.fault_latency.class(class);
                let labels: Labels = vec![
                    ("socket", k.socket.to_string()),
                    ("class", class.name().to_string()),
                ];
                m.encode_family(&labels)?.encode_histogram::<Labels>(
                    l.sum_us / 1e6,
                    l.count,
                    &l.coarse(),
                    None,
                )?;
            }
        }
        #[cfg(feature = "store")]
        if let Some(st) = &s.store {
            for (name, help, v) in [
                (
                    "guestmem_store_gets",
                    "GETs of frames from object storage (retries included)",
                    st.gets,
                ),
                (
                    "guestmem_store_fetched_bytes",
                    "bytes of frame objects fetched",
                    st.bytes_fetched,
                ),
                (
                    "guestmem_store_fetch_errors",
                    "GETs of frames that failed",
                    st.fetch_errors,
                ),
                (
                    "guestmem_store_hash_mismatches",
                    "frames whose bytes did not match their hash",
                    st.hash_mismatches,
                ),
                (
                    "guestmem_store_joined",
                    "fetches that waited on another VM's GET of the same frame",
                    st.joined,
                ),
                (
                    "guestmem_store_fetched_ahead",
                    "frames fetched ahead of the VMs",
                    st.fetched_ahead,
                ),
                (
                    "guestmem_store_staged",
                    "frames installed from memory, read ahead for their fill",
                    st.staged,
                ),
                (
                    "guestmem_cache_hits",
                    "frames read from the node-local cache",
                    st.cache_hits,
                ),
                (
                    "guestmem_cache_misses",
                    "frames looked for in the cache and not there",
                    st.cache_misses,
                ),
                (
                    "guestmem_cache_evictions",
                    "frames evicted from the cache",
                    st.cache_evictions,
                ),
                (
                    "guestmem_cache_uncached",
                    "frames not kept in the cache (no room, a disk error)",
                    st.cache_uncached,
                ),
            ] {
                counter(&mut enc, name, help, v)?;
            }
            gauge(
                &mut enc,
                "guestmem_store_ahead_limit",
                "read-ahead GETs that may be in flight now (cut while the store queues)",
                st.ahead_limit as i64,
            )?;
            gauge(
                &mut enc,
                "guestmem_cache_bytes",
                "bytes the frame cache holds",
                st.cache_bytes as i64,
            )?;
            let l = &st.fetch_latency;
            let mut m = enc.encode_descriptor(
                "guestmem_store_fetch_latency_seconds",
                "time from a frame's GET to its last byte",
                None,
                MetricType::Histogram,
            )?;
            m.encode_histogram::<Labels>(l.sum_us / 1e6, l.count, &l.coarse(), None)?;
        }
        Ok(())
    }
}

impl StatusHandle {
    /// The status in Prometheus' text format.
    pub fn prometheus(&self) -> String {
        encode(&self.snapshot())
    }
}

/// The status in Prometheus' text exposition format.
fn encode(s: &ServerStatus) -> String {
    let mut r = Registry::default();
    r.register_collector(Box::new(Scrape(s.clone())));
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &r);
    out
}
