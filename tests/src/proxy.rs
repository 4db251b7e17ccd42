use std::{net::SocketAddr, sync::Arc};

use tokio::{
    net::{TcpListener, TcpStream},
    sync::Mutex,
    task::JoinHandle,
};

/// A TCP proxy in front of Postgres. `cut` closes every connection and
/// refuses new ones, as a database outage would; `restore` listens again on
/// the same port.
pub struct TcpProxy {
    pub addr: SocketAddr,
    upstream: SocketAddr,
    acceptor: Mutex<Option<JoinHandle<()>>>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let proxy = Self {
            addr,
            upstream,
            acceptor: Mutex::new(None),
            connections: Arc::default(),
        };
        proxy.listen(listener).await;
        proxy
    }

    async fn listen(&self, listener: TcpListener) {
        let upstream = self.upstream;
        let connections = self.connections.clone();
        let acceptor = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let connection = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
                connections.lock().await.push(connection);
            }
        });
        *self.acceptor.lock().await = Some(acceptor);
    }

    /// Drops every connection and stops listening.
    pub async fn cut(&self) {
        if let Some(acceptor) = self.acceptor.lock().await.take() {
            acceptor.abort();
            let _ = acceptor.await;
        }
        for connection in self.connections.lock().await.drain(..) {
            connection.abort();
        }
    }

    /// Listens again on the same address.
    pub async fn restore(&self) {
        let listener = TcpListener::bind(self.addr).await.unwrap();
        self.listen(listener).await;
    }
}
