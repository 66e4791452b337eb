//! `stallprof report DIR --serve [ADDR]` and `--open`: the re-rendered
//! outputs served over HTTP for a browser, until Ctrl-C.
//!
//! In: the outputs' directory (opened once; nothing is read from anywhere
//! else but speedscope's app), the recording, and where speedscope's npm
//! package is. Out: the pages, on 127.0.0.1 unless an address is given:
//! - `/`: the stalls and a link to each output in its viewer
//!   ([`crate::report::index`]);
//! - `/<file>`: an output of the directory, by its plain name, only those
//!   `report` wrote;
//! - `/speedscope/…`: speedscope's static app from the installed package,
//!   opened with `#profileURL=/stalls.speedscope.json` so it fetches the
//!   recording from this server (nothing outside it).
//!
//! The server is the daemon's ([`crate::commands::web`]): its limits, and
//! files opened beneath a directory's descriptor without a symlink, never
//! by a path with `..` in it. Nothing is written. speedscope (MIT) is not
//! bundled: the page says how to install it when it is not found.
use std::{
    fs::File,
    io::Write as _,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::Arc,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use clap::Args;
use hyper::{Method, Request, StatusCode, body::Incoming};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::watch,
};

use crate::{
    commands::web::{self, Listener, Resp},
    model::{Recording, text::escape},
    os::outdir::OutDir,
    report::index::{self, Speedscope},
};

/// speedscope's npm release the served app and the tests are checked with.
pub const SPEEDSCOPE_VERSION: &str = "1.25.0";
/// What the page and the errors say to get it.
pub const SPEEDSCOPE_INSTALL: &str = "install it with `npm install -g speedscope@1.25.0` \
     (or give its directory: --speedscope DIR, SPEEDSCOPE_DIR)";
/// Where the app is served.
const SPEEDSCOPE_PATH: &str = "/speedscope/";

#[derive(Args, Debug, Clone, Default)]
pub struct ServeArgs {
    /// Serve the outputs over HTTP until Ctrl-C: a page of the stalls with
    /// a link to each file, the flamegraph, and speedscope with the
    /// recording loaded. ADDR defaults to 127.0.0.1 on a free port; any
    /// other address than loopback is used only when given, with a warning
    /// (whoever reaches it reads the recording).
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = "127.0.0.1:0")]
    pub serve: Option<SocketAddr>,
    /// `--serve`, and open the page in a browser (xdg-open) when there is
    /// a display; without one, the URL is printed as with --serve.
    #[arg(long)]
    pub open: bool,
    /// speedscope's npm package (the directory holding
    /// dist/release/index.html). Default: `npm root -g`, then
    /// ./node_modules.
    #[arg(long, value_name = "DIR", env = "SPEEDSCOPE_DIR")]
    pub speedscope: Option<PathBuf>,
}

impl ServeArgs {
    /// Serving was asked for.
    pub fn wanted(&self) -> bool {
        self.serve.is_some() || self.open
    }
}

/// speedscope's app: `dist/release` of the package at `dir` (or `dir`
/// itself when it is that directory), if its index.html is there.
fn app_dir(dir: &Path) -> Option<PathBuf> {
    [dir.join("dist/release"), dir.to_path_buf()]
        .into_iter()
        .find(|d| d.join("index.html").is_file() && d.join("file-format-schema.json").is_file())
}

/// Where speedscope's app is: the directory given (an error when it holds
/// none), else the global npm root's or ./node_modules' package; None when
/// none is found.
pub fn find_speedscope(given: Option<&Path>) -> Result<Option<PathBuf>> {
    if let Some(d) = given {
        return match app_dir(d) {
            Some(app) => Ok(Some(app)),
            None => bail!(
                "--speedscope {}: no speedscope app there (dist/release/index.html); \
                 give the npm package's directory, or {SPEEDSCOPE_INSTALL}",
                d.display()
            ),
        };
    }
    let npm_root = Command::new("npm")
        .args(["root", "-g"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    Ok(npm_root
        .into_iter()
        .chain([PathBuf::from("node_modules")])
        .find_map(|root| app_dir(&root.join("speedscope"))))
}

/// The version in the package.json above the app's `dist/release`.
fn speedscope_version(app: &Path) -> Option<String> {
    let text = std::fs::read_to_string(app.join("../../package.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v["version"].as_str().map(String::from)
}

/// What the server holds: the outputs' directory and its files, the page,
/// and speedscope's app directory.
struct Site {
    out: OutDir,
    files: Vec<String>,
    page: hyper::body::Bytes,
    speedscope: Option<File>,
}

fn handle(req: Request<Incoming>, site: &Site) -> Resp {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return web::text(StatusCode::METHOD_NOT_ALLOWED, "GET only\n");
    }
    let path = req.uri().path();
    if path == "/" || path == "/index.html" {
        return web::resp(
            StatusCode::OK,
            "text/html; charset=utf-8",
            site.page.clone(),
        );
    }
    if let Some(rel) = path.strip_prefix(SPEEDSCOPE_PATH) {
        return match &site.speedscope {
            Some(dir) => web::file_beneath(
                rustix::fd::AsFd::as_fd(dir),
                Path::new(rel),
                "not in speedscope's app\n",
            ),
            None => web::text(
                StatusCode::NOT_FOUND,
                format!("speedscope is not installed here: {SPEEDSCOPE_INSTALL}\n"),
            ),
        };
    }
    let name = &path[1..];
    if site.files.iter().any(|f| f == name) {
        return web::file_beneath(site.out.dir_fd(), Path::new(name), "no such output\n");
    }
    web::text(
        StatusCode::NOT_FOUND,
        "not found: the page at / links every output\n",
    )
}

/// Is there a display a browser could open on?
fn has_display() -> bool {
    ["DISPLAY", "WAYLAND_DISPLAY"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|d| !d.is_empty()))
}

/// Serves `out` (with `files`, re-rendered from `rec`) as `args` says,
/// after printing `summary`; returns what to print when stopped.
pub fn run(
    args: &ServeArgs,
    rec: &Recording,
    out: &OutDir,
    files: &[PathBuf],
    summary: &str,
) -> Result<String> {
    let app = find_speedscope(args.speedscope.as_deref())?;
    let files: Vec<String> = files
        .iter()
        .filter_map(|f| Some(f.file_name()?.to_str()?.to_string()))
        .collect();
    let dir_text = escape(&out.path().to_string_lossy()).into_owned();
    let speedscope = match &app {
        Some(_) => Speedscope::Served {
            url_path: SPEEDSCOPE_PATH,
        },
        None => Speedscope::Missing {
            install: SPEEDSCOPE_INSTALL,
        },
    };
    let page = index::page(rec, &files, &dir_text, speedscope);
    let speedscope_dir = match &app {
        Some(a) => Some(File::open(a).with_context(|| format!("opening {}", a.display()))?),
        None => None,
    };
    let site = Arc::new(Site {
        out: out.clone(),
        files,
        page: page.into(),
        speedscope: speedscope_dir,
    });
    let addr = args
        .serve
        .unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = Listener::tcp(addr, "choose another with --serve ADDR").await?;
        let bound = listener
            .local_addr()
            .context("the listening socket has no address")?;
        let shown = if bound.ip().is_unspecified() {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), bound.port())
        } else {
            bound
        };
        let url = format!("http://{shown}/");
        print!("{summary}");
        if !bound.ip().is_loopback() {
            eprintln!(
                "stallprof: WARNING: serving on {bound}, beyond this host's loopback: whoever \
                 reaches it reads the recording (stacks, file paths, thread names)"
            );
        }
        match &app {
            Some(a) => println!(
                "  speedscope {} from {}",
                speedscope_version(a).unwrap_or_else(|| "(version unknown)".into()),
                escape(&a.to_string_lossy())
            ),
            None => println!("  speedscope: not found; {SPEEDSCOPE_INSTALL}"),
        }
        println!("stallprof: serving {dir_text} at {url} (Ctrl-C stops)");
        if args.open {
            if has_display() {
                match Command::new("xdg-open")
                    .arg(&url)
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                {
                    // Reaped on its own thread: xdg-open may wait for the browser.
                    Ok(mut child) => {
                        std::thread::spawn(move || child.wait());
                    }
                    Err(e) => {
                        println!("stallprof: cannot run xdg-open ({e}): open {url} in a browser")
                    }
                }
            } else {
                println!(
                    "stallprof: no display (DISPLAY, WAYLAND_DISPLAY): open {url} in a browser"
                );
            }
        }
        let _ = std::io::stdout().flush();
        let limits = web::Limits {
            max_connections: 64,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
        };
        let (stop_tx, stop_rx) = watch::channel(false);
        let handler = move |req| {
            let site = site.clone();
            async move { handle(req, &site) }
        };
        let server = tokio::spawn(web::serve(listener, limits, handler, stop_rx));
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        tokio::select! {
            _ = sigint.recv() => {}
            _ = sigterm.recv() => {}
        }
        let _ = stop_tx.send(true);
        let _ = server.await;
        Ok("stallprof: stopped serving\n".to_string())
    })
}
