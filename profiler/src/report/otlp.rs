//! Stalls as OpenTelemetry spans: the OTLP trace request a tracing backend
//! receives (`ExportTraceServiceRequest`, opentelemetry-proto's types).
//!
//! In: finished stalls, the processes they ran in, the app's paths (for
//! culprits), and the offset from CLOCK_MONOTONIC to wall time. Out: one
//! `ResourceSpans` per process (its resource: `service.name` — the
//! process's own `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES`' when
//! its environment had one, else its command —, `process.pid`,
//! `process.executable.name`, `container.id`), one span per stall:
//! - named `event loop stall` (one name: backends group by it), kind
//!   internal, from the stall's start to its end in wall time;
//! - its attributes: the split (`stallprof.on_cpu_ns`, `…off_cpu_ns`,
//!   `…runqueue_ns`, `…throttled_ns`, `…gil_wait_ns`), the culprit and
//!   entry point as the summary names them, `thread.id`, `thread.name`,
//!   the request's route (`http.request.method`, `http.route`) and task;
//! - a link to the span the stalled task was in (`Task::trace`), so a
//!   trace UI shows the stall from the request that suffered it.
//!
//! Its own ids are random (a stall is no span of the request's trace: it
//! is linked, not parented). Nothing here does I/O: the transport is
//! `commands/otlp.rs`.

use opentelemetry_proto::tonic::{
    collector::trace::v1::ExportTraceServiceRequest,
    common::v1::{AnyValue, InstrumentationScope, KeyValue, any_value},
    resource::v1::Resource,
    trace::v1::{ResourceSpans, ScopeSpans, Span, span},
};

use crate::{
    classify::AppPaths,
    model::{PartKind, Process, Stall},
    report::aggregate,
};

/// The one span name of a stall.
pub const SPAN_NAME: &str = "event loop stall";

/// Where spans come from: the random source for their ids and the wall
/// clock's offset from CLOCK_MONOTONIC (`CLOCK_REALTIME - CLOCK_MONOTONIC`).
pub struct SpanClock {
    pub wall_offset_ns: i128,
    pub random: fn(&mut [u8]),
}

fn kv(key: &str, value: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.to_string(),
        value: Some(AnyValue { value: Some(value) }),
        ..Default::default()
    }
}

fn s(key: &str, v: impl Into<String>) -> KeyValue {
    kv(key, any_value::Value::StringValue(v.into()))
}

fn i(key: &str, v: u64) -> KeyValue {
    kv(
        key,
        any_value::Value::IntValue(v.min(i64::MAX as u64) as i64),
    )
}

/// Hex digits to bytes; None when not exactly `len` bytes of hex.
fn hex_bytes(hex: &str, len: usize) -> Option<Vec<u8>> {
    if hex.len() != 2 * len {
        return None;
    }
    (0..len)
        .map(|k| u8::from_str_radix(hex.get(2 * k..2 * k + 2)?, 16).ok())
        .collect()
}

/// The resource of a process: who its spans are from.
pub fn resource(p: &Process) -> Resource {
    let mut attributes = vec![
        s(
            "service.name",
            p.service.clone().unwrap_or_else(|| p.comm.clone()),
        ),
        i("process.pid", u64::from(p.pid)),
        s("process.executable.name", p.comm.clone()),
        s("telemetry.sdk.name", "stallprof"),
        s("telemetry.sdk.version", env!("CARGO_PKG_VERSION")),
    ];
    if let Some(role) = &p.role {
        attributes.push(s("stallprof.process.role", role.to_string()));
    }
    if let Some(c) = p.info.container.as_ref().and_then(|c| c.id.clone()) {
        attributes.push(s("container.id", c));
    }
    Resource {
        attributes,
        ..Default::default()
    }
}

/// A stall as a span.
pub fn span(stall: &Stall, app: &AppPaths, clock: &SpanClock) -> Span {
    let wall = |mono: u64| (i128::from(mono) + clock.wall_offset_ns).max(0) as u64;
    let mut trace_id = vec![0u8; 16];
    let mut span_id = vec![0u8; 8];
    (clock.random)(&mut trace_id);
    (clock.random)(&mut span_id);
    let gil: u64 = stall
        .stacks
        .iter()
        .filter(|p| p.kind == PartKind::GilWait)
        .map(|p| p.weight_ns)
        .sum();
    let mut attributes = vec![
        i("thread.id", u64::from(stall.tid)),
        s("thread.name", stall.thread_name.clone()),
        i("stallprof.duration_ns", stall.duration_ns),
        i("stallprof.on_cpu_ns", stall.on_cpu_ns),
        i("stallprof.off_cpu_ns", stall.off_cpu_ns),
        i("stallprof.runqueue_ns", stall.runqueue_ns),
        i("stallprof.throttled_ns", stall.throttled_ns),
        i("stallprof.gil_wait_ns", gil),
    ];
    if let Some(c) = aggregate::stall_culprit(stall, app) {
        attributes.push(s("stallprof.culprit", c));
    }
    if let Some(e) = aggregate::stall_entry(stall, app) {
        attributes.push(s("stallprof.entry", e));
    }
    if let Some(r) = &stall.route {
        attributes.push(s("http.request.method", r.method.clone()));
        attributes.push(s("http.route", r.template.clone()));
    }
    let mut links = Vec::new();
    if let Some(t) = &stall.task {
        attributes.push(s("stallprof.task", t.describe()));
    }
    if let Some(ids) = stall.trace()
        && let (Some(trace_id), Some(span_id)) =
            (hex_bytes(&ids.trace_id, 16), hex_bytes(&ids.span_id, 8))
    {
        links.push(span::Link {
            trace_id,
            span_id,
            attributes: vec![s("stallprof.link", "stalled request")],
            ..Default::default()
        });
    }
    if stall.incomplete {
        attributes.push(kv(
            "stallprof.incomplete",
            any_value::Value::BoolValue(true),
        ));
    }
    Span {
        trace_id,
        span_id,
        name: SPAN_NAME.into(),
        kind: span::SpanKind::Internal as i32,
        start_time_unix_nano: wall(stall.start_ns),
        end_time_unix_nano: wall(stall.end_ns),
        attributes,
        links,
        ..Default::default()
    }
}

/// The request for `stalls`, grouped by process (a stall of a process
/// not in `processes` gets a resource of its pid alone).
pub fn request(
    stalls: &[Stall],
    processes: &[Process],
    app: &AppPaths,
    clock: &SpanClock,
) -> ExportTraceServiceRequest {
    let mut by_pid: std::collections::BTreeMap<u32, Vec<Span>> = Default::default();
    for st in stalls {
        by_pid.entry(st.pid).or_default().push(span(st, app, clock));
    }
    let resource_spans = by_pid
        .into_iter()
        .map(|(pid, spans)| {
            let process = processes.iter().find(|p| p.pid == pid).cloned();
            let process = process.unwrap_or_else(|| Process {
                pid,
                comm: format!("pid {pid}"),
                info: Default::default(),
                parent: None,
                role: None,
                service: None,
            });
            ResourceSpans {
                resource: Some(resource(&process)),
                scope_spans: vec![ScopeSpans {
                    scope: Some(InstrumentationScope {
                        name: "stallprof".into(),
                        version: env!("CARGO_PKG_VERSION").into(),
                        ..Default::default()
                    }),
                    spans,
                    ..Default::default()
                }],
                ..Default::default()
            }
        })
        .collect();
    ExportTraceServiceRequest { resource_spans }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{SpanIds, Task};

    fn zeros(b: &mut [u8]) {
        b.iter_mut().enumerate().for_each(|(k, x)| *x = k as u8 + 1);
    }

    #[test]
    fn a_stall_is_a_span_linked_to_its_request() {
        let mut st = crate::testing::stall(5_000_000, vec![]);
        st.pid = 42;
        st.task = Some(Task {
            name: "Task-3".into(),
            trace: Some(SpanIds::new(0x2a59 << 64 | 7, 0x86ab)),
            ..Default::default()
        });
        let clock = SpanClock {
            wall_offset_ns: 1_700_000_000_000_000_000,
            random: zeros,
        };
        let p = Process {
            pid: 42,
            comm: "python3".into(),
            info: Default::default(),
            parent: None,
            role: None,
            service: Some("gateway".into()),
        };
        let req = request(&[st.clone()], &[p], &AppPaths::default(), &clock);
        let rs = &req.resource_spans[0];
        let attrs = &rs.resource.as_ref().unwrap().attributes;
        let get = |k: &str| {
            attrs
                .iter()
                .find(|a| a.key == k)
                .and_then(|a| a.value.clone())
        };
        assert_eq!(
            get("service.name").and_then(|v| v.value),
            Some(any_value::Value::StringValue("gateway".into()))
        );
        let sp = &rs.scope_spans[0].spans[0];
        assert_eq!(sp.name, SPAN_NAME);
        assert_eq!(
            sp.start_time_unix_nano,
            1_700_000_000_000_000_000 + st.start_ns
        );
        assert_eq!(
            sp.end_time_unix_nano - sp.start_time_unix_nano,
            st.end_ns - st.start_ns
        );
        assert_eq!(sp.links.len(), 1);
        assert_eq!(
            sp.links[0].trace_id,
            hex_bytes("0000000000002a590000000000000007", 16).unwrap()
        );
        assert_eq!(sp.links[0].span_id, vec![0, 0, 0, 0, 0, 0, 0x86, 0xab]);
        assert_eq!(sp.trace_id.len(), 16);
        assert_eq!(sp.span_id.len(), 8);
    }

    /// A plain callback's stall (no task) links to the span of its
    /// thread's own context.
    #[test]
    fn a_callbacks_stall_links_to_its_threads_span() {
        let mut st = crate::testing::stall(5_000_000, vec![]);
        st.thread_context = Some(crate::model::ContextTrace {
            trace: Some(SpanIds::new(0xbeef, 0x12)),
            trace_unreadable: None,
        });
        let clock = SpanClock {
            wall_offset_ns: 0,
            random: zeros,
        };
        let req = request(&[st], &[], &AppPaths::default(), &clock);
        let sp = &req.resource_spans[0].scope_spans[0].spans[0];
        assert_eq!(sp.links.len(), 1);
        assert_eq!(sp.links[0].span_id, vec![0, 0, 0, 0, 0, 0, 0, 0x12]);
    }
}
