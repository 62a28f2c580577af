//! What a user meets in the first hour with the HTTP server, each behaviour against a real
//! socket: request ids no client can guess or squat and the API key (`security`), a flood
//! of connections (`flood`), seeds and sampling options (`sampling`), DSML tool calls
//! (`tools`), and the rest of the surface — metrics formats checked by `promtool`, models,
//! tokenize, `X-Request-Id`, CORS, a malformed `Content-Length`, timeouts (`surface`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

#[path = "http_users/client.rs"]
mod client;
#[path = "http_users/flood.rs"]
mod flood;
#[path = "http_users/sampling.rs"]
mod sampling;
#[path = "http_users/security.rs"]
mod security;
#[path = "http_users/surface.rs"]
mod surface;
#[path = "http_users/tools.rs"]
mod tools;
