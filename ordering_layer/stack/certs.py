"""Certificates of the secured local stack: a self-signed CA and one server certificate it signs.

The server certificate names ``localhost`` and ``127.0.0.1``, so clients verify the host name.
Kafka reads it from a PKCS#12 keystore, Redis from PEM files; clients trust ``ca.pem``.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ordering_layer.stack.processes import write_private

_VALID_DAYS = 365


@dataclass(frozen=True)
class TlsFiles:
    """Where the stack's CA and server certificate live."""

    ca: Path
    cert: Path
    key: Path
    keystore: Path

    @classmethod
    def in_folder(cls, folder: Path) -> TlsFiles:
        """The file names inside ``folder``."""
        return cls(ca=folder / "ca.pem", cert=folder / "server.pem", key=folder / "server-key.pem",
                   keystore=folder / "server.p12")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ordering-layer local stack"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _certificate(subject: x509.Name, issuer: x509.Name, key: rsa.RSAPrivateKey, signer: rsa.RSAPrivateKey,
                 extensions: list[tuple[x509.ExtensionType, bool]]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=_VALID_DAYS)))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signer, hashes.SHA256())


def make_certificates(folder: Path, keystore_password: str) -> TlsFiles:
    """Create the CA, the server key and certificate, and the keystore in ``folder`` (kept if present).

    Args:
        folder: where to write (keys are readable by the owner only).
        keystore_password: protects the PKCS#12 keystore Kafka reads.
    """
    files = TlsFiles.in_folder(folder)
    if all(path.exists() for path in (files.ca, files.cert, files.key, files.keystore)):
        return files
    ca_key, server_key = _key(), _key()
    ca_name = _name("ordering-layer test CA")
    ca = _certificate(ca_name, ca_name, ca_key, ca_key, [
        (x509.BasicConstraints(ca=True, path_length=0), True),
        (x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                       data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                       encipher_only=False, decipher_only=False), True)])
    server = _certificate(_name("localhost"), ca_name, server_key, ca_key, [
        (x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
         False),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False)])
    pem = serialization.Encoding.PEM
    folder.mkdir(parents=True, exist_ok=True)
    files.ca.write_bytes(ca.public_bytes(pem))
    files.cert.write_bytes(server.public_bytes(pem) + ca.public_bytes(pem))
    write_private(files.key, server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    # AES-256 and an HMAC-SHA256 MAC: what Java 17's PKCS#12 reader accepts (the legacy RC2/3DES
    # default of older tools is refused by some JDK security settings).
    encryption = (serialization.PrivateFormat.PKCS12.encryption_builder().kdf_rounds(50_000)
                  .key_cert_algorithm(pkcs12.PBES.PBESv2SHA256AndAES256CBC).hmac_hash(hashes.SHA256())
                  .build(keystore_password.encode()))
    write_private(files.keystore,
                  pkcs12.serialize_key_and_certificates(b"server", server_key, server, [ca], encryption))
    return files
