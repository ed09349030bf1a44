"""Convert documents in a warm LibreOffice over UNO (run by Debian's python3, which has `uno`).

One conversion:
    python3 uno_convert.py PIPE SOURCE DEST FILTER[|OPTIONS]
exits 0 when DEST was written, 2 when LibreOffice could not load or store it, 3 when the instance
cannot be reached (yet).

The bridge (started by a warm slot's supervisor, kept for the instance's life):
    python3 uno_convert.py --serve PIPE SOCKET
connects once and answers conversions sent over a Unix socket, one line each way:
"SOURCE\\tDEST\\tFILTER\\n" → "0\\n" | "2 reason\\n" | "3\\n". It saves a conversion the start of a
Python and of its UNO connection; it ends (and the converter falls back to the one-shot form)
when its instance does.
"""

import os
import socket
import sys
import time

import uno  # noqa: E402 (Debian's python3-uno)
from com.sun.star.beans import PropertyValue
from com.sun.star.connection import NoConnectException

START_S = 20.0


def prop(name, value):
    item = PropertyValue()
    item.Name, item.Value = name, value
    return item


def desktop_of(pipe):
    local = uno.getComponentContext()
    resolver = local.ServiceManager.createInstanceWithContext("com.sun.star.bridge.UnoUrlResolver", local)
    context = resolver.resolve(f"uno:pipe,name={pipe};urp;StarOffice.ComponentContext")
    return context.ServiceManager.createInstanceWithContext("com.sun.star.frame.Desktop", context)


def convert(desktop, source, dest, export):
    filter_name, _, options = export.partition("|")
    document = desktop.loadComponentFromURL(uno.systemPathToFileUrl(source), "_blank", 0,
                                            (prop("Hidden", True), prop("ReadOnly", True)))
    if document is None:
        return 2
    try:
        store = [prop("FilterName", filter_name)]
        if options:
            store.append(prop("FilterOptions", options))
        document.storeToURL(uno.systemPathToFileUrl(dest), tuple(store))
    finally:
        document.close(True)
    return 0


def main() -> int:
    pipe, source, dest, export = sys.argv[1:5]
    try:
        desktop = desktop_of(pipe)
    except NoConnectException:
        return 3
    return convert(desktop, source, dest, export)


def serve(pipe, path) -> int:
    deadline = time.monotonic() + START_S
    while True:
        try:
            desktop = desktop_of(pipe)
            break
        except NoConnectException:
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    temporary = f"{path}.{os.getpid()}"
    listener.bind(temporary)
    listener.listen(4)
    os.replace(temporary, path)  # converters see the socket only once it answers
    while True:
        connection, _ = listener.accept()
        with connection:
            line = connection.makefile("r", encoding="utf-8").readline().rstrip("\n")
            try:
                source, dest, export = line.split("\t")
                answer = f"{convert(desktop, source, dest, export)}"
            except NoConnectException:
                answer = "3"
            except Exception as error:  # the instance may be gone: say so, then end with it
                connection.sendall(f"2 {type(error).__name__}\n".encode())
                if "Disposed" in type(error).__name__ or "Runtime" in type(error).__name__:
                    return 2
                continue
            connection.sendall(f"{answer}\n".encode())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve(sys.argv[2], sys.argv[3]))
    sys.exit(main())
