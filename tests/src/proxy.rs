use std::{net::SocketAddr, sync::Arc};

use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::{TcpListener, TcpSocket, TcpStream},
    sync::{Mutex, watch},
    task::JoinHandle,
};

/// A TCP proxy in front of Postgres. `cut` closes every connection and
/// refuses new ones, as a database outage would; `restore` listens again on
/// the same port, which stays bound meanwhile (no other test's listener can
/// be handed it). `freeze` stops forwarding without closing anything (new
/// connections are accepted and then hang), as when the database's host
/// stops answering or its processes are stopped; `thaw` resumes.
pub struct TcpProxy {
    pub addr: SocketAddr,
    upstream: SocketAddr,
    acceptor: Mutex<Option<JoinHandle<()>>>,
    /// While cut: the port, bound and not listening, so that connections to
    /// it are refused.
    held: Mutex<Option<TcpSocket>>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    frozen: watch::Sender<bool>,
}

/// Waits while the proxy is frozen.
async fn while_frozen(frozen: &mut watch::Receiver<bool>) {
    let _ = frozen.wait_for(|frozen| !frozen).await;
}

/// Copies `from` to `to`, holding every chunk back while the proxy is frozen.
async fn forward(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    mut frozen: watch::Receiver<bool>,
) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        while_frozen(&mut frozen).await;
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        while_frozen(&mut frozen).await;
        if to.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let proxy = Self {
            addr,
            upstream,
            acceptor: Mutex::new(None),
            held: Mutex::new(None),
            connections: Arc::default(),
            frozen: watch::Sender::new(false),
        };
        proxy.listen(listener).await;
        proxy
    }

    async fn listen(&self, listener: TcpListener) {
        let upstream = self.upstream;
        let connections = self.connections.clone();
        let frozen = self.frozen.clone();
        let acceptor = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let mut frozen = frozen.subscribe();
                let connection = tokio::spawn(async move {
                    while_frozen(&mut frozen).await;
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        let (client_read, client_write) = client.into_split();
                        let (server_read, server_write) = server.into_split();
                        tokio::join!(
                            forward(client_read, server_write, frozen.clone()),
                            forward(server_read, client_write, frozen),
                        );
                    }
                });
                connections.lock().await.push(connection);
            }
        });
        *self.acceptor.lock().await = Some(acceptor);
    }

    /// Drops every connection and stops listening; the port stays bound.
    pub async fn cut(&self) {
        if let Some(acceptor) = self.acceptor.lock().await.take() {
            acceptor.abort();
            let _ = acceptor.await;
            *self.held.lock().await = Some(self.bind());
        }
        // Awaited, so that no byte is forwarded once this returns: a task
        // aborted but not yet stopped would still carry what a client
        // writes right after the cut (a message on an open stream goes out
        // at once) to the server.
        let connections: Vec<_> = self.connections.lock().await.drain(..).collect();
        for connection in connections {
            connection.abort();
            let _ = connection.await;
        }
    }

    /// The proxy's port, bound. Reusing the address, as a listener does:
    /// the proxy's closed connections linger on it in TIME_WAIT.
    fn bind(&self) -> TcpSocket {
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_reuseaddr(true).unwrap();
        socket.bind(self.addr).unwrap();
        socket
    }

    /// Stops forwarding bytes, in both directions and on every connection,
    /// without closing any: statements neither arrive nor answer.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Forwards again what was held back and what comes next.
    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }

    /// Listens again on the same address.
    pub async fn restore(&self) {
        let socket = self.held.lock().await.take();
        let listener = socket.unwrap_or_else(|| self.bind()).listen(1024).unwrap();
        self.listen(listener).await;
    }
}
