"""Convert one document in a warm LibreOffice over UNO (run by Debian's python3, which has `uno`):
    python3 uno_convert.py PIPE SOURCE DEST FILTER[|OPTIONS]
Exit 0 when DEST was written; 3 when the instance cannot be reached (yet)."""

import sys

import uno  # noqa: E402 (Debian's python3-uno)
from com.sun.star.beans import PropertyValue
from com.sun.star.connection import NoConnectException


def prop(name, value):
    item = PropertyValue()
    item.Name, item.Value = name, value
    return item


def main() -> int:
    pipe, source, dest, export = sys.argv[1:5]
    filter_name, _, options = export.partition("|")
    local = uno.getComponentContext()
    resolver = local.ServiceManager.createInstanceWithContext("com.sun.star.bridge.UnoUrlResolver", local)
    try:
        context = resolver.resolve(f"uno:pipe,name={pipe};urp;StarOffice.ComponentContext")
    except NoConnectException:
        return 3
    desktop = context.ServiceManager.createInstanceWithContext("com.sun.star.frame.Desktop", context)
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


if __name__ == "__main__":
    sys.exit(main())
