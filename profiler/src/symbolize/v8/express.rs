//! The route of the express request a stalled Node loop serves: `POST
//! /signup`, as the application declared it (`req.baseUrl` +
//! `req.route.path`), never the requested URL.
//!
//! In: the JavaScript frames of one stack event of the stall ([`JsSlot`]s,
//! with the receiver and first argument each frame was passed, taken from
//! the stack copy at sample time). Out: a [`Route`], or a [`RouteRead`]
//! miss.
//!
//! How. express (4's `lib/router/`, 5's `router` package) calls each
//! handler from its router's code, passing the request first: the
//! router's `handle`, the route's `dispatch`, the layer's `handleRequest`
//! (express 4: `handle`) in `index.js`, `route.js` and `layer.js` take
//! `req` as their first argument. The innermost such frame's `req` is
//! taken when the function that made it is Node's `IncomingMessage`
//! (other router code on the stack, such as the app's routes being set up
//! at its start, is no request); the router sets
//! `req.route` (an object made by express's `Route`, whose `path` is the
//! template) before it calls the route's handlers, and `req.baseUrl` to
//! the path of the router it is mounted on. `req.method` is the HTTP
//! method. A request object is young and may have moved (a scavenge)
//! since the sample: it is then not found there, the miss is said, and the
//! next stack event of the stall (whose copy has its new address) is read.
//! No frame of a router: not an express request (not counted).

use super::JsResolver;
use super::objects::Property;
use crate::kernel::event::JsSlot;
use crate::model::Route;
use crate::symbolize::request::RouteRead;

/// Script paths of express's router (express 4's own, 5's `router`).
const ROUTER_FILES: &[&str] = &[
    "/router/lib/route.js",
    "/router/lib/layer.js",
    "/router/index.js",
    "/express/lib/router/route.js",
    "/express/lib/router/layer.js",
    "/express/lib/router/index.js",
];

/// The router's functions that are passed the request first.
const REQUEST_FUNCTIONS: &[&str] = &["handle", "dispatch", "handleRequest", "handle_request"];

/// Most router frames whose first argument is looked at.
const MAX_TRIED: usize = 8;

fn in_router(file: &str) -> bool {
    ROUTER_FILES.iter().any(|f| file.ends_with(f))
}

/// Is `frame` the router's code serving a request, passed it first?
fn serves_request(frame: &crate::model::Frame) -> bool {
    frame.file.as_deref().is_some_and(in_router) && REQUEST_FUNCTIONS.contains(&&*frame.name)
}

impl JsResolver {
    /// The route of the express request the stack `slots` (innermost
    /// first) serves.
    pub fn express_route(&mut self, slots: &[JsSlot]) -> Result<Route, RouteRead> {
        let mut router_frames = 0;
        let mut last_miss = None;
        for slot in slots {
            let frame = match self.cached(slot) {
                Some(f) => f,
                None => match self.resolve(slot.func) {
                    Some(f) => f,
                    None => continue,
                },
            };
            if !serves_request(&frame) || slot.arg0 == 0 {
                continue;
            }
            router_frames += 1;
            if router_frames > MAX_TRIED {
                break;
            }
            match self.request_route(slot.arg0) {
                Ok(r) => return Ok(r),
                // Not a request: another router frame's argument may be.
                Err(None) => {}
                Err(Some(miss)) => return Err(miss),
            }
            last_miss.get_or_insert(RouteRead::Unreadable(
                "no first argument of the router's request-serving frames was a request \
                 that could be read (it may have moved since the sample)"
                    .into(),
            ));
        }
        Err(last_miss.unwrap_or(RouteRead::NoRequest))
    }

    /// The route of the request at tagged `req`. `Err(None)`: not an
    /// `IncomingMessage` (another object, or moved from there).
    fn request_route(&mut self, req: u64) -> Result<Route, Option<RouteRead>> {
        let made_by = self.constructor(req).map_err(|_| None)?;
        if made_by.name != "IncomingMessage" {
            return Err(None);
        }
        let unreadable = |why: String| Some(RouteRead::Unreadable(why));
        let route = match self
            .own_property(req, "route")
            .map_err(|e| unreadable(format!("req.route: {e}")))?
        {
            Property::Value(v) if self.constructor(v).is_ok_and(|f| f.name == "Route") => v,
            Property::Value(_) | Property::Absent => return Err(Some(RouteRead::Unrouted)),
            Property::Accessor => return Err(unreadable("req.route is a getter".into())),
        };
        let path = self
            .string_property(route, "path")
            .map_err(|e| unreadable(format!("req.route.path: {e}")))?
            .ok_or_else(|| {
                unreadable("req.route.path is not a string (a RegExp or an array)".into())
            })?;
        let method = self
            .string_property(req, "method")
            .map_err(|e| unreadable(format!("req.method: {e}")))?
            .ok_or_else(|| unreadable("req.method is not a string".into()))?;
        let base = self
            .string_property(req, "baseUrl")
            .map_err(|e| unreadable(format!("req.baseUrl: {e}")))?
            .unwrap_or_default();
        Ok(Route {
            method: method.to_ascii_uppercase(),
            template: format!("{base}{path}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_files_of_express_4_and_5() {
        assert!(in_router("/srv/app/node_modules/router/lib/route.js"));
        assert!(in_router("/srv/app/node_modules/router/index.js"));
        assert!(in_router(
            "/srv/app/node_modules/express/lib/router/layer.js"
        ));
        assert!(!in_router(
            "/srv/app/node_modules/express/lib/application.js"
        ));
        assert!(!in_router("/srv/app/app.js"));
    }

    #[test]
    fn only_request_serving_router_frames() {
        let f = |name: &str, file: &str| crate::model::Frame {
            file: Some(file.into()),
            ..crate::model::Frame::new(name, crate::model::FrameKind::Js)
        };
        let route = "/srv/app/node_modules/router/lib/route.js";
        assert!(serves_request(&f("dispatch", route)));
        assert!(serves_request(&f(
            "handleRequest",
            "/srv/app/node_modules/router/lib/layer.js"
        )));
        // Setting up routes at start, and the router's `next(err)`.
        assert!(!serves_request(&f(
            "route",
            "/srv/app/node_modules/router/index.js"
        )));
        assert!(!serves_request(&f("next", route)));
        assert!(!serves_request(&f("dispatch", "/srv/app/app.js")));
    }
}
