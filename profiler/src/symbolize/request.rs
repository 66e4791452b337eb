//! What a read of a stalled request's route found, for every runtime that
//! reads one: ASGI and aiohttp ([`super::request::RouteReader`]), express
//! ([`super::v8::JsResolver::express_route`]). The reads table
//! (`pipeline::reads`) keeps the best of a stall's reads and counts its
//! misses (`asgi_route_*`, named for the first runtime read).

/// What one read found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteRead {
    /// The request's method (`WEBSOCKET` for a websocket) and route
    /// template, checked against the stack.
    Route { method: String, template: String },
    /// No frame of the stack serves a request the runtime's reader knows
    /// (no ASGI `scope` local, no aiohttp request, no express router
    /// frame): not counted.
    NoRequest,
    /// The request was read, but it has no route (not routed yet, or no
    /// route matched).
    Unrouted,
    /// A request ran, but the one read is not provably the stall's (the
    /// loop had moved on, or the stall had ended, before the read).
    Unverified,
    /// The request or its route could not be read; says why.
    Unreadable(String),
}
