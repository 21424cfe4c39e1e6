package agent

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"time"
)

// TLS on the broker-to-agent channel. Each sandbox has its own key and self-signed certificate,
// made by the broker and kept with the agent's secret in the sandbox's Secret (files CertFile and
// KeyFile beside the secret in the pod). The agent serves TLS 1.3 only, with that certificate; the
// broker pins that exact certificate (its DER bytes) when it dials: no CA, no host name, no
// validity dates. So a pod on the network can neither read nor change the traffic, and whatever
// answers at a pod's address without the sandbox's key is refused before a byte of a request
// leaves the broker. The secret's challenge-response (wire.go) still runs inside TLS: it is how
// the agent knows the broker (TLS here authenticates the agent only), and it keeps a leaked
// certificate, which is not secret, from being enough.

// Names of the sandbox's certificate and key (PEM), beside the secret.
const (
	CertFile = "tls.crt"
	KeyFile  = "tls.key"
)

// NewCredentials makes a sandbox's key (Ed25519) and its self-signed certificate, both PEM.
func NewCredentials() (certPEM, keyPEM []byte, err error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "sbx-agent"},
		// Pinning ignores dates; these only keep tools that read the certificate quiet.
		NotBefore:   now.Add(-time.Hour),
		NotAfter:    now.AddDate(100, 0, 0),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, pub, priv)
	if err != nil {
		return nil, nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), nil
}

// ServerTLS is the agent's TLS: TLS 1.3 only, with the sandbox's certificate and key.
func ServerTLS(certPEM, keyPEM []byte) (*tls.Config, error) {
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		// The error names neither the key nor its bytes.
		return nil, errors.New("agent: the sandbox's TLS certificate and key do not load")
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13, MaxVersion: tls.VersionTLS13}, nil
}

// ErrNotPinned is a peer whose certificate is not the pinned one.
var ErrNotPinned = errors.New("the peer's certificate is not the sandbox's agent certificate")

// ClientTLS is the broker's TLS to one sandbox's agent: TLS 1.3 only, and the agent must present
// exactly certPEM's certificate. Each config has its own session cache, so a connection after the
// first resumes a session of this sandbox's agent and skips the certificate's signature and its
// check. The pin is checked in VerifyConnection, which crypto/tls runs on every connection,
// resumed ones included, against the certificate the session was made with; it skips
// VerifyPeerCertificate when it resumes, so a pin checked only there would not hold for a session
// the cache was handed from anywhere else.
func ClientTLS(certPEM []byte) (*tls.Config, error) {
	b, _ := pem.Decode(certPEM)
	if b == nil || b.Type != "CERTIFICATE" {
		return nil, errors.New("agent: the sandbox's TLS certificate is not a PEM certificate")
	}
	if _, err := x509.ParseCertificate(b.Bytes); err != nil {
		return nil, errors.New("agent: the sandbox's TLS certificate does not parse")
	}
	pin := b.Bytes
	return &tls.Config{
		MinVersion: tls.VersionTLS13, MaxVersion: tls.VersionTLS13,
		// No CA and no host name: the check is the pin below, which crypto/tls runs in their place.
		InsecureSkipVerify: true,
		// One sandbox's agent has one address per pod, and a new pod gets a new config.
		ClientSessionCache: tls.NewLRUClientSessionCache(4),
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) != 1 || !bytes.Equal(cs.PeerCertificates[0].Raw, pin) {
				return ErrNotPinned
			}
			return nil
		},
	}, nil
}
